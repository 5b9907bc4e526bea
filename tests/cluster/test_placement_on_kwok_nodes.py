"""spec.placement on the real kube-scheduler: fake p5en nodes in three zones, two bottom-layer network nodes
per zone; the rendered StatefulSets are created as the operator would create them and the scheduler
places the pods. Nodes of a private pool (label + taint) keep other tests' pods off them and ours on them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kvferry.local.controlplane import ControlPlane, nodes
from kvferry.operator.render.objects import render

from tests.cluster.operator_fixtures import WAIT_S
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

POOL_LABEL = "kvferry.io/test-pool"
# zone -> bottom-layer network node of each of its nodes: b has two spines of two nodes, c one of two.
LAYOUT = {"us-test-1b": (0, 0, 1, 1), "us-test-1c": (0, 0)}
FIRST_INDEX = 100  # p5en-100...: clear of the plane's default p5en-0, p5en-1


def _node(index: int, zone: str, spine: int, pool: str) -> dict[str, Any]:
    body = nodes.manifest(nodes.P5EN, index, zone=zone, network=nodes.network_nodes(zone, spine))
    body["metadata"]["labels"][POOL_LABEL] = pool
    body["spec"]["taints"].append({"key": POOL_LABEL, "value": pool, "effect": "NoSchedule"})
    return body


@pytest.fixture
def pool(control_plane: ControlPlane, namespace: str) -> Iterator[dict[str, dict[str, str]]]:
    """Six private p5en nodes; yields node name -> its labels. Deleted afterwards."""
    bodies, index = [], FIRST_INDEX
    for zone, spines in LAYOUT.items():
        for spine in spines:
            bodies.append(_node(index, zone, spine, namespace))
            index += 1
    control_plane.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": bodies})
    )
    for body in bodies:  # kwok reads allocatable from status, which apply does not write
        name = body["metadata"]["name"]
        patch = json.dumps({"status": body["status"]})
        control_plane.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p", patch)
    names = [b["metadata"]["name"] for b in bodies]
    control_plane.wait_nodes_ready(names)
    try:
        yield {b["metadata"]["name"]: b["metadata"]["labels"] for b in bodies}
    finally:
        # Engine pods have long grace periods (model drain) which kwok honours: force them out first.
        for args in (
            ("delete", "statefulsets", "--all", "--wait=false"),
            ("delete", "pods", "--all", "--grace-period=0", "--force", "--wait=false"),
        ):
            control_plane.kubectl("-n", namespace, *args, check=False)
        control_plane.kubectl("delete", "node", *names, "--wait=false", check=False)


def _create_engines(control_plane: ControlPlane, namespace: str, cr: dict[str, Any]) -> None:
    """The CR's StatefulSets as render() makes them, on the private pool (every pod takes a whole node)."""
    cr["metadata"]["namespace"] = namespace
    for obj in render(cr).objects:
        if obj["kind"] != "StatefulSet":
            continue
        pod = obj["spec"]["template"]["spec"]
        pod["nodeSelector"] = {**pod.get("nodeSelector", {}), POOL_LABEL: namespace}
        pod["tolerations"] = [*pod.get("tolerations", []), {"key": POOL_LABEL, "operator": "Exists"}]
        control_plane.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(obj))


def _pods(control_plane: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    out = control_plane.kubectl("-n", namespace, "get", "pods", "-o", "json").stdout
    return json.loads(out)["items"]


def _placed(control_plane: ControlPlane, namespace: str, count: int) -> dict[str, str]:
    """Pod name -> node name, once `count` pods are bound to nodes."""

    def bound() -> dict[str, str]:
        return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in _pods(control_plane, namespace)}

    return wait_until(
        bound, f"{count} pods bound", WAIT_S, until=lambda b: len(b) == count and all(b.values())
    )


def _cr(name: str, placement: dict[str, str], prefill: int = 1, decode: int = 1) -> dict[str, Any]:
    # TP 8: one pod per p5en node, so where each pod lands is the scheduler's choice, not bin packing.
    return (
        make_inference(name, accelerator="p5en", placement=placement)
        .prefill(replicas=prefill, tensorParallelSize=8)
        .decode(replicas=decode, tensorParallelSize=8)
        .obj()
    )


def test_required_zone_and_preferred_network_put_p_and_d_under_one_spine(control_plane, namespace, pool):
    cr = _cr("near", {"sameZone": "required", "networkTopology": "preferred"})
    _create_engines(control_plane, namespace, cr)
    placed = _placed(control_plane, namespace, 2)
    zones = {pool[node][nodes.ZONE] for node in placed.values()}
    spines = {pool[node][nodes.NETWORK_LAYERS[2]] for node in placed.values()}
    assert len(set(placed.values())) == 2, placed
    assert len(zones) == 1 and len(spines) == 1, f"P and D apart: {placed}"


def test_required_zone_leaves_a_pod_pending_rather_than_crossing_zones(control_plane, namespace, pool):
    """Once P and D hold a zone, one decode pod more than it holds waits, though another zone has room."""
    _create_engines(control_plane, namespace, _cr("pinned", {"sameZone": "required"}))
    placed = _placed(control_plane, namespace, 2)
    (zone,) = {pool[node][nodes.ZONE] for node in placed.values()}
    room = sum(1 for labels in pool.values() if labels[nodes.ZONE] == zone)  # nodes = pods the zone holds
    decode = room  # P holds one node of the zone: one decode pod too many
    control_plane.kubectl("-n", namespace, "scale", "statefulset", "pinned-decode", f"--replicas={decode}")

    def pending() -> list[dict[str, Any]]:
        pods = _pods(control_plane, namespace)
        return (
            [p for p in pods if not p["spec"].get("nodeName") and _unschedulable(p)]
            if len(pods) == 1 + decode
            else []
        )

    (waiting,) = wait_until(pending, "one decode pod Unschedulable", WAIT_S)
    message = next(c["message"] for c in waiting["status"]["conditions"] if c["type"] == "PodScheduled")
    assert "affinity" in message, message
    bound = {p["spec"]["nodeName"] for p in _pods(control_plane, namespace) if p["spec"].get("nodeName")}
    assert {pool[node][nodes.ZONE] for node in bound} == {zone}
    free_elsewhere = [n for n, labels in pool.items() if labels[nodes.ZONE] != zone and n not in bound]
    assert free_elsewhere, "the other zone had room: the pod waits by policy, not for capacity"


def _unschedulable(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)
