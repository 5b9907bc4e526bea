"""Names step: label keys, annotation keys and object-name helpers shared by render, apply and status.

Every key the operator writes lives here, each with a comment saying what it is applied to; the keys
other parts read come from kvferry.contracts.labels.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvferry.contracts import labels

GROUP = "kvferry.io"
FIELD_MANAGER = "kvferry"  # the one server-side-apply field manager for everything the operator writes

# Keys the router and connector rely on too: defined, with what each is applied to, in contracts/labels.py.
LABEL_NAME = labels.NAME
LABEL_ROLE = labels.ROLE
LABEL_REVISION = labels.REVISION
# Applied to every rendered object: lets the operator watch only what it made.
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "kvferry"
LABEL_APP = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"

# Applied to the router pod template: hash of the router config, so a config change rolls the router.
ANNOTATION_CONFIG_HASH = "kvferry.io/config-hash"
# kopf keeps its progress and diff base in annotations under this prefix, never in status.
KOPF_PREFIX = "kvferry.io"

ROLES = ("prefill", "decode")
HTTP_PORT = 8000
MAX_NAME = 63  # DNS-1123 labels and label values are capped at 63 characters


def fit(name: str, limit: int = MAX_NAME) -> str:
    """Truncate `name` to `limit` characters, keeping it unique with a short hash suffix.

    Kubernetes caps object names used as DNS labels (Services) and label values at 63 characters;
    cutting without a hash would let two long CR names collide on the same child name.
    """
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{digest}"


def role_name(cr_name: str, role: str) -> str:
    """StatefulSet, headless Service, PDB and ConfigMap-key name of one role: `<cr>-<role>`."""
    return fit(f"{cr_name}-{role}")


def router_name(cr_name: str) -> str:
    """Router Deployment, ServiceAccount, Role and RoleBinding: `<cr>-router`."""
    return fit(f"{cr_name}-router")


def config_name(cr_name: str) -> str:
    return fit(f"{cr_name}-config")


def transfer_token_name(cr_name: str) -> str:
    """The Secret holding the CR's transfer token (created by the apply step, mounted by both roles)."""
    return fit(f"{cr_name}-transfer-token")


def service_name(cr_name: str) -> str:
    """The client-facing Service (the endpoint) carries the CR's own name."""
    return fit(cr_name)


def selector_labels(cr_name: str, role: str) -> dict[str, str]:
    """Immutable StatefulSet/Deployment selectors: never include the revision (it changes)."""
    return {LABEL_NAME: fit(cr_name), LABEL_ROLE: role}


def common_labels(cr_name: str, role: str) -> dict[str, str]:
    return {
        LABEL_APP: "kvferry",
        LABEL_INSTANCE: fit(cr_name),
        LABEL_COMPONENT: role,
        LABEL_MANAGED_BY: MANAGED_BY,
        **selector_labels(cr_name, role),
    }


def short_hash(data: str, length: int = 10) -> str:
    return hashlib.sha256(data.encode()).hexdigest()[:length]


def owned_by_role_set(pod: dict[str, Any], cr_name: str, role: str) -> bool:
    """Whether a StatefulSet we render controls the pod (a labelled pod made by hand is not read)."""
    want = role_name(cr_name, role)
    refs = pod["metadata"].get("ownerReferences") or []
    return any(r.get("controller") and r.get("kind") == "StatefulSet" and r.get("name") == want for r in refs)
