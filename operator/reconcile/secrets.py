"""Secret check step: every Secret a CR references must exist; only metadata is read, never the data.

The rendered pods read the values themselves (secretKeyRef); the operator only learns whether each
Secret exists, so a missing one becomes a condition and an event naming it instead of pods stuck in
CreateContainerConfigError. A missing key inside an existing Secret is reported by the kubelet.
"""

from __future__ import annotations

from kvferry.operator.reconcile.apply import Kube
from kvferry.operator.render.security import referenced_secrets
from kvferry.operator.spec import Spec


def missing_secrets(kube: Kube, namespace: str, spec: Spec) -> str:
    """'' when every referenced Secret exists, else one message naming each missing Secret and key."""
    missing = [
        f"secret {name} (key {key}, {used_by}) not found in namespace {namespace}"
        for name, key, used_by in referenced_secrets(spec)
        if not kube.exists("Secret", namespace, name)
    ]
    return "; ".join(missing)
