"""Network step: copy the EC2 network-node labels of each engine pod's node onto the pod.

EKS labels nodes of instance types with EC2 instance topology (p5en, trn2, ...) with the network node
above them at layers 1..3 (topology.k8s.aws/network-node-layer-N); Kubernetes copies only zone and
region onto the pods it binds. The router ranks P/D pairs by these layers (router/topology.py), reading
its pods' labels, and is not granted Nodes (each router runs in a user namespace). So the operator, on
its metrics timer, reads each node an engine pod of the CR is bound to (once: the labels are fixed for
an instance's life; cached with a bound) and labels the pod where its layers differ, in one merge patch
under the field manager `kvferry`. Nodes without the labels (other clouds, other instance types) add
nothing, and the router's choice is as before. Only pods of the CR's own StatefulSets (by UID) are labelled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from kvferry.contracts.labels import NETWORK_LAYERS
from kvferry.operator.reconcile.apply import Kube, KubeError, not_controlled
from kvferry.operator.spec import names

log = logging.getLogger(__name__)

NODE_TTL_S = 3600.0  # a node name is reused only by a new instance, which a deleted node precedes
FAILED_TTL_S = 60.0  # a node that could not be read is tried again after this
MAX_NODES = 10_000  # the cache's bound: ~200 bytes per node


def layers(node_labels: Mapping[str, str]) -> dict[str, str]:
    """The node's network-node labels (empty when it has none)."""
    return {k: node_labels[k] for k in NETWORK_LAYERS if node_labels.get(k)}


def missing(pod: dict[str, Any], node_layers: Mapping[str, str]) -> dict[str, str]:
    """The labels to set on `pod` so its layers equal its node's ({} when they already do)."""
    have = pod["metadata"].get("labels") or {}
    return {k: v for k, v in node_layers.items() if have.get(k) != v}


def to_label(pods: list[dict[str, Any]], owners: Mapping[str, str]) -> list[tuple[dict[str, Any], str]]:
    """(pod, its StatefulSet's UID) of the CR's live engine pods bound to a node. `owners`: role ->
    UID of the role's StatefulSet, which the caller found controlled by the CR (by UID); a pod
    counts only if that StatefulSet controls it (a labelled pod made by hand is never written)."""
    out = []
    for pod in pods:
        meta = pod["metadata"]
        role = (meta.get("labels") or {}).get(names.LABEL_ROLE)
        if role not in names.ROLES or meta.get("deletionTimestamp") or not pod["spec"].get("nodeName"):
            continue
        uid = owners.get(role, "")
        if uid and not_controlled(pod, uid, "Pod") is None:
            out.append((pod, uid))
    return out


class NodeLayers:
    """Node name -> its network-node labels, read once per NODE_TTL_S, at most MAX_NODES kept."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_nodes: int = MAX_NODES) -> None:
        self._clock = clock
        self._max = max_nodes
        self._cache: OrderedDict[str, tuple[float, dict[str, str]]] = OrderedDict()
        self._lock = threading.Lock()  # timers of several CRs run on kopf's threads at once

    def get(self, kube: Kube, node: str) -> dict[str, str]:
        with self._lock:
            hit = self._cache.get(node)
            if hit is not None and hit[0] > self._clock():
                self._cache.move_to_end(node)
                return hit[1]
        ttl = NODE_TTL_S
        try:  # outside the lock: one slow read holds up no other CR
            obj = kube.get("Node", None, node)
            found = layers((obj or {}).get("metadata", {}).get("labels") or {})
        except KubeError as exc:  # e.g. RBAC without nodes get: say so once a minute, not every tick
            log.warning("cannot read node %s for its network labels: %s", node, exc)
            found, ttl = {}, FAILED_TTL_S
        with self._lock:
            self._cache[node] = (self._clock() + ttl, found)
            self._cache.move_to_end(node)
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return found


def label_pods(kube: Kube, pods: list[dict[str, Any]], owners: Mapping[str, str], nodes: NodeLayers) -> int:
    """Label the CR's bound engine pods with their node's layers; update `pods` in place; return how many
    were patched. Every patch goes through Kube.patch_labels (the ownership gate, over the pod as
    listed). A failed read or patch is logged and left to the next tick: status is still written."""
    patched = 0
    for pod, owner_uid in to_label(pods, owners):
        meta = pod["metadata"]
        try:
            want = missing(pod, nodes.get(kube, pod["spec"]["nodeName"]))
            if not want:
                continue
            kube.patch_labels("Pod", pod, owner_uid, want)
        except KubeError as exc:  # NotControlled included: the pod changed hands since the list
            log.warning("network labels of pod %s/%s: %s", meta["namespace"], meta["name"], exc)
            continue
        meta["labels"] = {**(meta.get("labels") or {}), **want}
        patched += 1
    return patched
