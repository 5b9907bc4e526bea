"""Topology step (pure): where an engine runs, and how close two engines are.

An engine's place is a path, broadest first: zone, then the EKS network node at layers 1, 2, 3 (empty
where unknown). Two engines are as close as the number of leading levels they share: 0 across zones
(EFA does not cross them, so a P/D pair there cannot transfer), 1 in one zone, 4 under one bottom-layer
network node (fewest hops). Discovery fills the zone from the EndpointSlice, which Kubernetes copies
from the pod's node for every endpoint, so no extra permission is needed; the network layers come from
the pod's own labels, which the operator copies from its node (operator/reconcile/network.py: Kubernetes
copies only zone and region onto pods, and the router is not granted Nodes). Unknown levels match nothing,
so without topology every pair is equally close and selection is as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvferry.contracts.labels import NETWORK_LAYERS, ZONE

Place = tuple[str, ...]


def closeness(a: Sequence[str], b: Sequence[str]) -> int:
    """Leading levels two places share; an unknown (empty) level ends the count."""
    n = 0
    for x, y in zip(a, b, strict=False):  # a shorter path is unknown below its end
        if not x or x != y:
            break
        n += 1
    return n


def place(slice_zone: str | None, pod_labels: Mapping[str, str]) -> Place:
    """An engine's place from its EndpointSlice endpoint's zone and its pod's labels; () when unknown."""
    levels = [slice_zone or pod_labels.get(ZONE, ""), *(pod_labels.get(k, "") for k in NETWORK_LAYERS)]
    while levels and not levels[-1]:
        levels.pop()
    return tuple(levels)
