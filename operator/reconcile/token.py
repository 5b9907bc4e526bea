"""Transfer token step: the CR's Secret holding the random token its engines' side channels require.

Why: a rank's side channel hands out its NIXL agent metadata, and with it anyone can WRITE into the
rank's KV blocks; the NetworkPolicy admits by labels, which anyone who can create pods can set. Each
DisaggregatedInference gets one token (32 random bytes, base64) in `<cr>-transfer-token`, owned by the
CR (garbage-collected with it) and immutable; render mounts it read-only into both roles
(render/security.py `transfer_token`), and the connector answers only peers proving it
(connector/sideauth.py).

The token is random, so render (pure, repeatable) never holds it: this step creates the Secret if
absent and never updates it, through `Kube.create_owned` (a name held by anything the CR does not
control is a Conflict, never taken over). A Secret verified as the CR's is not read again for
VERIFIED_S, so a steady reconcile costs no request for it.
"""

from __future__ import annotations

import base64
import secrets
import threading
import time
from typing import Any

from kvferry.contracts import pods
from kvferry.operator.reconcile.apply import Kube
from kvferry.operator.render.objects import owner_reference
from kvferry.operator.spec import Inference, names

TOKEN_BYTES = 32
VERIFIED_S = 300.0  # a deleted Secret is recreated within this (pods that mount it wait for it)
MAX_VERIFIED = 100_000  # CRs remembered; past it the memory starts over (each costs one request again)
_verified: dict[tuple[str, str, str], float] = {}  # (namespace, name, CR uid) -> when found the CR's
_lock = threading.Lock()


def secret(cr: Inference) -> dict[str, Any]:
    """The Secret to create: a fresh random token, owned by the CR, immutable."""
    token = base64.b64encode(secrets.token_bytes(TOKEN_BYTES)).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": names.transfer_token_name(cr.meta.name),
            "namespace": cr.meta.namespace,
            "labels": names.common_labels(cr.meta.name, "transfer"),
            "ownerReferences": [owner_reference(cr.meta)],
        },
        "type": "Opaque",
        "immutable": True,  # never rotated silently; to rotate, delete it and restart both roles
        "stringData": {pods.TRANSFER_TOKEN_KEY: token},
    }


def ensure(kube: Kube, cr: Inference, now: float | None = None) -> bool:
    """The CR's token Secret exists and is the CR's: True when this call created it. Raises
    NotControlled for a Secret of that name the CR does not control, KubeError for API errors."""
    now = time.monotonic() if now is None else now
    key = (cr.meta.namespace, names.transfer_token_name(cr.meta.name), cr.meta.uid)
    with _lock:
        seen = _verified.get(key)
    if seen is not None and now - seen < VERIFIED_S:
        return False
    created = kube.create_owned(secret(cr), cr.meta.uid)
    with _lock:
        if len(_verified) >= MAX_VERIFIED:
            _verified.clear()
        _verified[key] = now
    return created
