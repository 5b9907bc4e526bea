"""Landed step (pure): the engine pods of one CR -> where each role landed (zones and, on EKS instance
types with EC2 instance topology, the bottom-layer network nodes), for status.placement.

The zone is read from the pod, not its node: from Kubernetes 1.35 the API server copies the node's
topology.kubernetes.io/zone label onto every pod it binds (PodTopologyLabelsAdmission, beta, on by
default), so the operator needs no access to Nodes. A bound pod without the label (an older cluster, a
node without a zone) counts as "unknown". The network nodes are the
topology.k8s.aws/network-node-layer-3 labels the operator copies from the node
(operator/reconcile/network.py); pods without it are not listed there.
"""

from __future__ import annotations

from typing import Any

from kvferry.contracts.labels import NETWORK_LAYERS
from kvferry.operator.render.placement import ZONE
from kvferry.operator.spec import names

UNKNOWN = "unknown"


def landed(pods: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Role -> {zones: sorted zones of its bound pods, pods: how many are bound, networkNodes: the sorted
    bottom-layer network nodes of those that have one}."""
    out: dict[str, dict[str, Any]] = {}
    for role in names.ROLES:
        bound = [
            p
            for p in pods
            if (p["metadata"].get("labels") or {}).get(names.LABEL_ROLE) == role
            and (p.get("spec") or {}).get("nodeName")
        ]
        labels = [p["metadata"].get("labels") or {} for p in bound]
        zones = {pod.get(ZONE, UNKNOWN) for pod in labels}
        spines = {pod[NETWORK_LAYERS[-1]] for pod in labels if pod.get(NETWORK_LAYERS[-1])}
        out[role] = {"zones": sorted(zones), "pods": len(bound), "networkNodes": sorted(spines)}
    return out


def summary(placement: dict[str, dict[str, Any]]) -> str:
    """One word for `kubectl get`: the zone all engine pods share, `split` across zones, or empty."""
    zones = {z for role in placement.values() for z in role["zones"]}
    return "" if not zones else zones.pop() if len(zones) == 1 else "split"
