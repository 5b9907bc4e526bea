"""status.placement: zones of each role's bound pods, from the zone label the API server copies onto pods
it binds; carried by status writers that did not list pods."""

from __future__ import annotations

from typing import Any

from kvferry.operator.status.conditions import Observed, summarize
from kvferry.operator.status.landed import landed, summary


def _pod(role: str, node: str | None, zone: str | None) -> dict[str, Any]:
    labels = {"kvferry.io/role": role, **({"topology.kubernetes.io/zone": zone} if zone else {})}
    return {"metadata": {"labels": labels}, "spec": {"nodeName": node} if node else {}}


def test_zones_per_role_of_bound_pods_only() -> None:
    pods = [
        _pod("prefill", "n1", "z1"),
        _pod("decode", "n2", "z1"),
        _pod("decode", "n3", "z2"),
        _pod("decode", None, None),  # Pending: not counted
        _pod("router", "n1", "z1"),
    ]
    roles = landed(pods)
    assert roles == {
        "prefill": {"zones": ["z1"], "pods": 1, "networkNodes": []},
        "decode": {"zones": ["z1", "z2"], "pods": 2, "networkNodes": []},
    }
    assert summary(roles) == "split"
    assert summary(landed(pods[:2])) == "z1"
    assert summary(landed([])) == ""


def test_a_bound_pod_without_the_label_is_unknown_not_dropped() -> None:
    assert landed([_pod("prefill", "n1", None)])["prefill"] == {
        "zones": ["unknown"],
        "pods": 1,
        "networkNodes": [],
    }


def test_bottom_layer_network_nodes_of_bound_pods_that_have_one() -> None:
    layer3 = "topology.k8s.aws/network-node-layer-3"
    pods = [_pod("prefill", "n1", "z1"), _pod("prefill", "n2", "z1"), _pod("prefill", None, "z1")]
    pods[0]["metadata"]["labels"][layer3] = "nn-b"
    pods[1]["metadata"]["labels"][layer3] = "nn-a"
    pods[2]["metadata"]["labels"][layer3] = "nn-c"  # not bound: not counted
    assert landed(pods)["prefill"]["networkNodes"] == ["nn-a", "nn-b"]


def test_placement_is_carried_by_writers_that_did_not_look() -> None:
    kw: dict[str, Any] = dict(
        cr_name="svc",
        namespace="ns",
        generation=1,
        revision="r",
        desired={"prefill": 1, "decode": 1},
        router_replicas=1,
        now="t",
    )
    seen = {**landed([_pod("prefill", "n1", "z1")]), "zone": "z1"}
    first = summarize(Observed(faults={}, placement=seen), previous={}, **kw)
    assert summarize(Observed(), previous=first, **kw)["placement"] == seen
    assert "placement" not in summarize(Observed(faults={}), previous={}, **kw)
