"""Autoscale writer (I/O): a role's desired replicas -> its StatefulSet's /scale, or a gauge for HPA/KEDA.

With `output: scale` the operator patches `spec.replicas` through the StatefulSet's scale subresource
(RBAC: statefulsets/scale get, patch; nothing else of the object), conditional on the resourceVersion
the planner read it at: a change it did not see (a person's `kubectl scale`, a rollout) makes the
write fail with 409 and the next evaluation plans from the new state instead of overwriting it.

Either output sets `kvferry_autoscale_desired_replicas{namespace,name,role}` on the operator's metrics
port, so a cluster that prefers an HPA (through prometheus-adapter) or KEDA (prometheus scaler) can
act on the planner's decisions itself (docs/autoscaling.md).
"""

from __future__ import annotations

import contextlib

from kubernetes.client.exceptions import ApiException
from kvferry.operator import names
from kvferry.operator.apply import REQUEST_TIMEOUT_S, Kube, KubeError
from kvferry.operator.selfmetrics import AUTOSCALE_DESIRED as DESIRED

MERGE_PATCH = "application/merge-patch+json"


def publish_desired(namespace: str, cr_name: str, role: str, replicas: int) -> None:
    DESIRED.labels(namespace, cr_name, role).set(replicas)


def forget(namespace: str, cr_name: str) -> None:
    """Drop a deleted CR's gauges (a stale desired value would keep an external scaler acting)."""
    for role in names.ROLES:
        with contextlib.suppress(KeyError):  # never published
            DESIRED.remove(namespace, cr_name, role)


def scale(kube: Kube, namespace: str, cr_name: str, role: str, replicas: int, resource_version: str) -> None:
    """Set the role's StatefulSet replicas through /scale, only over `resource_version`; KubeError else."""
    name = names.role_name(cr_name, role)
    body = {"metadata": {"resourceVersion": resource_version}, "spec": {"replicas": replicas}}
    # Imported here: the generated API module and its models are ~12 MiB of an operator that only
    # scales when a CR asks for it (issue 19; every other request goes through Kube's raw calls).
    from kubernetes.client import AppsV1Api

    try:
        AppsV1Api(kube.api).patch_namespaced_stateful_set_scale(
            name, namespace, body, _content_type=MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT_S
        )
    except ApiException as exc:
        raise KubeError(exc.status or 0, f"scale StatefulSet {namespace}/{name}: {exc.reason}") from exc
    except Exception as exc:  # urllib3 transport errors: reported, the next evaluation tries again
        raise KubeError(0, f"scale StatefulSet {namespace}/{name}: {exc}") from exc
