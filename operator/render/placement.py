"""Placement step (pure): spec.placement + the user's own affinity -> one role's pod affinity.

P and D of one service must land together: KV moves over EFA, which does not cross availability zones,
and is fastest under one network spine. Both roles' pods get the same pod-affinity terms selecting
every engine pod of the service, so whichever pod is placed first pins the zone (and attracts the
others to its network nodes). The scheduler lets the first pod of a required term land anywhere when it
matches its own term and nothing else does yet, which is why the selector includes the pod's own role.
"""

from __future__ import annotations

import copy
from typing import Any

from kvferry.operator.spec import EFA_ACCELERATORS, Spec, SpecError, names

ZONE = "topology.kubernetes.io/zone"
# EKS labels nodes of instance types with EC2 instance topology with the network node above them at
# each layer; layer 1 is the top (broadest), layer 3 the bottom (closest). Source: EKS user guide,
# "Place distributed AI/ML workloads with network topology labels" (docs/install.md "Placement").
NETWORK_LAYERS = (
    ("topology.k8s.aws/network-node-layer-3", 100),  # same bottom network node: fewest hops
    ("topology.k8s.aws/network-node-layer-2", 50),
    ("topology.k8s.aws/network-node-layer-1", 25),
)
ZONE_WEIGHT = 100
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def policy(spec: Spec) -> tuple[str, str]:
    """(sameZone, networkTopology) in effect: unset fields follow the preset (preferred on EFA)."""
    efa = spec.accelerator in EFA_ACCELERATORS
    same_zone = spec.placement.same_zone or ("preferred" if efa else "none")
    network = spec.placement.network_topology or ("preferred" if efa else "none")
    return same_zone, network


def engine_selector(cr_name: str) -> dict[str, Any]:
    """Every engine pod (prefill and decode, not the router) of one service."""
    return {
        "matchLabels": {names.LABEL_NAME: names.fit(cr_name)},
        "matchExpressions": [{"key": names.LABEL_ROLE, "operator": "In", "values": list(names.ROLES)}],
    }


def _term(cr_name: str, topology_key: str) -> dict[str, Any]:
    return {"labelSelector": engine_selector(cr_name), "topologyKey": topology_key}


def terms(spec: Spec, cr_name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(required, preferred) pod-affinity terms the policy asks for."""
    same_zone, network = policy(spec)
    required: list[dict[str, Any]] = []
    preferred: list[dict[str, Any]] = []
    if same_zone == "required":
        required.append(_term(cr_name, ZONE))
    elif same_zone == "preferred":
        preferred.append({"weight": ZONE_WEIGHT, "podAffinityTerm": _term(cr_name, ZONE)})
    if network == "preferred":
        preferred += [{"weight": w, "podAffinityTerm": _term(cr_name, key)} for key, w in NETWORK_LAYERS]
    return required, preferred


def affinity(spec: Spec, cr_name: str, role: str) -> dict[str, Any]:
    """Role `role`'s affinity from the spec with the policy's pod-affinity terms after the user's own.

    Nothing of the user's is replaced: node affinity and pod anti-affinity pass through, and the user's
    pod-affinity terms stay first in each list. An empty policy returns the user's affinity as given.
    """
    required, preferred = terms(spec, cr_name)
    merged: dict[str, Any] = copy.deepcopy(getattr(spec, role).affinity)
    if not required and not preferred:
        return merged
    pod = merged.setdefault("podAffinity", {})
    path = f"spec.{role}.affinity.podAffinity"
    if not isinstance(pod, dict):
        raise SpecError([f"{path}: expected a mapping (Kubernetes PodAffinity), got {type(pod).__name__}"])
    for key in (REQUIRED, PREFERRED):
        if not isinstance(pod.get(key) or [], list):
            raise SpecError([f"{path}.{key}: expected a list, got {type(pod[key]).__name__}"])
    if required:
        pod[REQUIRED] = [*(pod.get(REQUIRED) or []), *required]
    if preferred:
        pod[PREFERRED] = [*(pod.get(PREFERRED) or []), *preferred]
    return merged


# Kueue's plain-pod group keys (sigs.k8s.io/kueue pkg/controller/constants and jobs/pod/constants): pods
# sharing a group name in one namespace are one Workload, admitted when all `total-count` pods fit.
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_SERVING = "kueue.x-k8s.io/pod-group-serving"  # long-running: a replaced pod rejoins the group


def gang_group(cr_name: str) -> str:
    return names.fit(f"{cr_name}-engines")


def gang_metadata(spec: Spec, cr_name: str, pods: int) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) of every engine pod for spec.placement.gang; `pods`: the group's size
    (both roles, every pod of every multi-node group). Empty for gang none."""
    if spec.placement.gang != "kueue":
        return {}, {}
    labels = {KUEUE_QUEUE: spec.placement.queue_name or "", KUEUE_GROUP: gang_group(cr_name)}
    return labels, {KUEUE_TOTAL: str(pods), KUEUE_SERVING: "true"}
