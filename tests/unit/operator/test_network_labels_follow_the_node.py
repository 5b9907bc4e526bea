"""operator/reconcile/network.py: an engine pod gets its node's EC2 network-node labels (only those, only
on the CR's own bound engine pods, by the UID of the CR's StatefulSet), each node is read once per TTL,
and a failed read neither raises nor stops the other pods."""

from __future__ import annotations

from typing import Any

from kvferry.operator.reconcile import network
from kvferry.operator.reconcile.apply import KubeError

L1, L2, L3 = (f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3))
NODES = {
    "gpu-1": {L1: "nn-top", L2: "nn-mid", L3: "nn-a", "topology.kubernetes.io/zone": "z1"},
    "gpu-2": {L1: "nn-top", L2: "nn-mid", L3: "nn-b"},
    "plain": {"topology.kubernetes.io/zone": "z1"},
}


class StandInKube:
    """Node reads and label patches, recorded (pure-logic test: the real API server is in tests/cluster)."""

    def __init__(self, forbidden: set[str] | None = None) -> None:
        self.reads: list[str] = []
        self.patches: list[tuple[str, dict[str, str]]] = []
        self.forbidden = forbidden or set()

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert kind == "Node" and namespace is None
        self.reads.append(name)
        if name in self.forbidden:
            raise KubeError(403, f'nodes "{name}" is forbidden')
        return {"metadata": {"labels": NODES[name]}} if name in NODES else None

    def patch_labels(self, kind: str, pod: dict[str, Any], owner_uid: str, labels: dict[str, str]) -> dict:
        assert kind == "Pod" and pod["metadata"]["namespace"] == "ns"
        assert owner_uid == UIDS[pod["metadata"]["ownerReferences"][0]["name"]]
        self.patches.append((pod["metadata"]["name"], labels))
        return {}


# role -> UID of the CR's own StatefulSet of that role (scrape.role_owners finds them by the CR's UID)
UIDS = {"svc-prefill": "uid-p", "svc-decode": "uid-d"}
OWNERS = {"prefill": "uid-p", "decode": "uid-d"}


def _pod(
    name: str,
    node: str | None,
    role: str = "prefill",
    owner: str = "svc-prefill",
    uid: str = "",
    **labels: str,
):
    ref = {"kind": "StatefulSet", "name": owner, "controller": True, "uid": uid or UIDS.get(owner, "x")}
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "labels": {"kvferry.io/role": role, **labels},
        "ownerReferences": [ref],
    }
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}}


def test_bound_engine_pods_get_their_nodes_layers_and_nothing_else() -> None:
    kube = StandInKube()
    pods = [
        _pod("svc-prefill-0", "gpu-1"),
        _pod("svc-decode-0", "gpu-2", role="decode", owner="svc-decode"),
        _pod("svc-prefill-1", None),  # Pending
        _pod("svc-router-x", "gpu-1", role="router"),  # not an engine
        _pod("by-hand", "gpu-1", owner="someone-else"),  # labelled like ours, not our StatefulSet's
        # named like ours, but of another StatefulSet `svc-prefill` (another team's, or a CR of the
        # same name deleted and recreated): a name proves nothing, the UID does
        _pod("svc-prefill-9", "gpu-1", uid="uid-of-another-svc-prefill"),
        _pod("svc-prefill-2", "plain"),  # a node without network topology
    ]
    assert network.label_pods(kube, pods, OWNERS, network.NodeLayers()) == 2  # type: ignore[arg-type]
    assert kube.patches == [
        ("svc-prefill-0", {L1: "nn-top", L2: "nn-mid", L3: "nn-a"}),
        ("svc-decode-0", {L1: "nn-top", L2: "nn-mid", L3: "nn-b"}),
    ]
    assert pods[0]["metadata"]["labels"][L3] == "nn-a"  # updated in place, for status.placement
    assert "topology.kubernetes.io/zone" not in pods[0]["metadata"]["labels"]  # the API server's job


def test_a_pod_already_labelled_is_not_patched_and_a_stale_label_is_corrected() -> None:
    kube = StandInKube()
    right = _pod("svc-prefill-0", "gpu-1", **{L1: "nn-top", L2: "nn-mid", L3: "nn-a"})
    stale = _pod("svc-prefill-1", "gpu-2", **{L1: "nn-top", L2: "nn-mid", L3: "nn-a"})
    assert network.label_pods(kube, [right, stale], OWNERS, network.NodeLayers()) == 1  # type: ignore[arg-type]
    assert kube.patches == [("svc-prefill-1", {L3: "nn-b"})]


def test_each_node_is_read_once_per_ttl_and_the_cache_is_bounded() -> None:
    now = [0.0]
    kube, cache = StandInKube(), network.NodeLayers(clock=lambda: now[0], max_nodes=2)
    for _ in range(3):
        cache.get(kube, "gpu-1")  # type: ignore[arg-type]
    assert kube.reads == ["gpu-1"]
    now[0] = network.NODE_TTL_S + 1
    cache.get(kube, "gpu-1")  # type: ignore[arg-type]
    assert kube.reads == ["gpu-1", "gpu-1"]
    cache.get(kube, "gpu-2")  # type: ignore[arg-type]
    cache.get(kube, "plain")  # type: ignore[arg-type]  # evicts gpu-1, the least recently used
    cache.get(kube, "gpu-1")  # type: ignore[arg-type]
    assert kube.reads[-1] == "gpu-1" and len(kube.reads) == 5


def test_a_node_that_cannot_be_read_is_skipped_retried_later_and_the_others_still_labelled() -> None:
    now = [0.0]
    kube, cache = StandInKube(forbidden={"gpu-1"}), network.NodeLayers(clock=lambda: now[0])
    pods = [_pod("svc-prefill-0", "gpu-1"), _pod("svc-prefill-1", "gpu-2")]
    assert network.label_pods(kube, pods, OWNERS, cache) == 1  # type: ignore[arg-type]
    assert [name for name, _ in kube.patches] == ["svc-prefill-1"]
    network.label_pods(kube, pods, OWNERS, cache)  # type: ignore[arg-type]
    assert kube.reads.count("gpu-1") == 1  # not asked again on every tick
    now[0] = network.FAILED_TTL_S + 1
    network.label_pods(kube, pods, OWNERS, cache)  # type: ignore[arg-type]
    assert kube.reads.count("gpu-1") == 2
