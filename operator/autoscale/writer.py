"""Autoscale writer (I/O): a role's desired replicas -> its StatefulSet's /scale, or a gauge for HPA/KEDA.

With `output: scale` the operator patches `spec.replicas` through the StatefulSet's scale subresource
(RBAC: statefulsets/scale get, patch; nothing else of the object), only on a StatefulSet whose
controller owner reference is the CR's UID (a CR `db` must not resize another team's `db-prefill`),
conditional on the resourceVersion the planner read it at: a change it did not see (a person's
`kubectl scale`, a rollout) makes the write fail with 409 and the next evaluation plans from the new
state instead of overwriting it.

Either output sets `kvferry_autoscale_desired_replicas{namespace,name,role}` on the operator's metrics
port, so a cluster that prefers an HPA (through prometheus-adapter) or KEDA (prometheus scaler) can
act on the planner's decisions itself (docs/autoscaling.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

from kvferry.operator.reconcile.apply import Kube
from kvferry.operator.runtime.selfmetrics import AUTOSCALE_DESIRED as DESIRED
from kvferry.operator.spec import names


def publish_desired(namespace: str, cr_name: str, role: str, replicas: int) -> None:
    DESIRED.labels(namespace, cr_name, role).set(replicas)


def forget(namespace: str, cr_name: str) -> None:
    """Drop a deleted CR's gauges (a stale desired value would keep an external scaler acting)."""
    for role in names.ROLES:
        with contextlib.suppress(KeyError):  # never published
            DESIRED.remove(namespace, cr_name, role)


def scale(kube: Kube, sts: dict[str, Any], cr_uid: str, replicas: int) -> None:
    """Set a role's StatefulSet replicas through /scale, only over `sts` as read and only if the CR
    (by UID) controls it: Kube.write_owned, the operator's one ownership gate. NotControlled (nothing
    written) when it is someone else's, KubeError (409) when it changed since the read."""
    kube.scale(sts, cr_uid, replicas)
