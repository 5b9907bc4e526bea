"""Roles wider than one node on the real API server with the real LeaderWorkerSet controller (built from
sigs.k8s.io/lws, its webhooks registered by URL): the p5en multi-node example's objects are accepted, and
an LWS-backed decode role's pods carry the rank environment vLLM's multi-node flags read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kvferry.local.controlplane import ControlPlane
from kvferry.local.controlplane.lws import Lws
from kvferry.operator.render.groups import GROUP_INDEX_ENV, LABEL_GROUP_INDEX, LABEL_WORKER_INDEX
from kvferry.operator.render.objects import render

from tests.cluster.installkit import EXAMPLES
from tests.cluster.operator_fixtures import WAIT_S
from tests.waiting import wait_until

EXAMPLE = EXAMPLES / "p5en-multinode-decode.yaml"


@pytest.fixture(scope="module")
def lws(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lws]:
    with Lws(control_plane).start(tmp_path_factory.mktemp("lws")) as running:
        yield running


def _rendered(cr: dict[str, Any], namespace: str) -> list[dict[str, Any]]:
    cr = {**cr, "metadata": {**cr["metadata"], "namespace": namespace}}
    return render(cr).objects


def test_the_p5en_multinode_example_is_accepted_with_lws_installed(
    control_plane, kvferry_crd, lws, namespace
):
    cr = yaml.safe_load(EXAMPLE.read_text())
    control_plane.kubectl("-n", namespace, "apply", "--dry-run=server", "-f", str(EXAMPLE))
    objects = _rendered(cr, namespace)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds.count("LeaderWorkerSet") == 1 and kinds.count("StatefulSet") == 1, kinds
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    # Server-side: schema, defaulting and LWS's own admission webhooks judge every object.
    out = control_plane.kubectl(
        "-n", namespace, "apply", "--server-side", "--dry-run=server", "-f", "-", input=body
    )
    assert (
        "leaderworkerset.leaderworkerset.x-k8s.io/bloom-wide-decode-decode serverside-applied" in out.stdout
    )


def _pods(control_plane: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    return json.loads(control_plane.kubectl("-n", namespace, "get", "pods", "-o", "json").stdout)["items"]


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    (vllm,) = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in vllm["env"]}


@pytest.fixture
def group_namespace(control_plane: ControlPlane, namespace: str) -> Iterator[str]:
    """The test's namespace; afterwards its group and pods go at once (kwok honours the engines' long
    grace periods), so the plane's two p5en nodes are free for the next test."""
    yield namespace
    for args in (
        ("delete", "leaderworkersets", "--all", "--wait=false"),
        ("delete", "pods", "--all", "--grace-period=0", "--force", "--wait=false"),
    ):
        control_plane.kubectl("-n", namespace, *args, check=False)


def test_an_lws_decode_group_runs_with_each_pods_rank(control_plane, lws, group_namespace):
    """One decode replica of two p5en nodes on the plane's two fake p5en nodes: LWS makes the leader and
    the worker, its webhook gives each its rank, kube-scheduler and kwok run them."""
    namespace = group_namespace
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["spec"]["decode"]["replicas"] = 1
    cr["spec"]["placement"] = {"sameZone": "none", "networkTopology": "none"}
    (group,) = [o for o in _rendered(cr, namespace) if o["kind"] == "LeaderWorkerSet"]
    role_service = next(
        o
        for o in _rendered(cr, namespace)
        if o["kind"] == "Service" and o["metadata"]["name"] == "bloom-wide-decode-decode"
    )
    for obj in (role_service, group):
        control_plane.kubectl("-n", namespace, "apply", "--server-side", "-f", "-", input=json.dumps(obj))

    def running() -> list[dict[str, Any]]:
        pods = _pods(control_plane, namespace)
        return pods if len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods) else []

    pods = {
        p["metadata"]["name"]: p for p in wait_until(running, "the decode group's 2 pods Running", WAIT_S)
    }
    leader, worker = pods["bloom-wide-decode-decode-0"], pods["bloom-wide-decode-decode-0-1"]
    assert leader["spec"]["nodeName"] != worker["spec"]["nodeName"]  # one pod per node
    for pod, rank in ((leader, "0"), (worker, "1")):
        env = _env(pod)
        assert env["LWS_WORKER_INDEX"] == rank == pod["metadata"]["labels"][LABEL_WORKER_INDEX]
        assert env["LWS_GROUP_SIZE"] == "2"
        # Workers resolve the leader through the group's own headless Service (UniquePerReplica).
        assert (
            env["LWS_LEADER_ADDRESS"] == f"bloom-wide-decode-decode-0.bloom-wide-decode-decode-0.{namespace}"
        )
        # The engine id the connector gets, bloom-wide-decode-decode-$(LWS_GROUP_INDEX), is the leader's name.
        assert pod["metadata"]["labels"][LABEL_GROUP_INDEX] == "0"
        assert env[GROUP_INDEX_ENV] == {
            "fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.labels['{LABEL_GROUP_INDEX}']"}
        }
    (container,) = [c for c in worker["spec"]["containers"] if c["name"] == "vllm"]
    assert container["args"][-9:] == [
        *("--nnodes", "2", "--node-rank", "$(LWS_WORKER_INDEX)"),
        *("--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", "29501", "--headless"),
    ]

    def endpoints() -> set[str]:
        out = control_plane.kubectl(
            "-n",
            namespace,
            "get",
            "endpointslices",
            "-l",
            "kubernetes.io/service-name=bloom-wide-decode-decode",
            "-o",
            "json",
        ).stdout
        return {e["targetRef"]["name"] for s in json.loads(out)["items"] for e in s.get("endpoints") or []}

    # The router discovers engines from the role's Service: only the leader serves HTTP.
    assert wait_until(endpoints, "the decode Service's endpoints", WAIT_S) == {"bloom-wide-decode-decode-0"}
