"""A decode role wider than one node renders as a LeaderWorkerSet: one pod per node, vLLM's multi-node flags
with LWS's rank variables, one engine id per group, and only the leader behind the role's Service."""

from __future__ import annotations

import json
from typing import Any

from kvferry.operator.render.groups import GROUP_INDEX_ENV, LABEL_GROUP_INDEX, LABEL_WORKER_INDEX
from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference


def _objects(cr: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render(cr).objects}


def _vllm(pod_template: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod_template["spec"]["containers"] if c["name"] == "vllm"]
    return container


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _wide_decode(**kv: Any) -> dict[str, Any]:
    cr = make_inference("ds", accelerator="p5en").decode(replicas=2, tensorParallelSize=16)
    return (cr.kv(**kv) if kv else cr).obj()


def test_a_decode_wider_than_a_node_is_a_group_of_whole_nodes_per_replica() -> None:
    objs = _objects(_wide_decode())
    assert ("StatefulSet", "ds-decode") not in objs and ("StatefulSet", "ds-prefill") in objs
    lws = objs[("LeaderWorkerSet", "ds-decode")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    for key in ("leaderTemplate", "workerTemplate"):
        vllm = _vllm(lws["spec"]["leaderWorkerTemplate"][key])
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 8  # one node's share of TP 16
        assert vllm["resources"]["limits"]["vpc.amazonaws.com/efa"] == 16
        assert _flag(vllm["args"], "--tensor-parallel-size") == "16"  # vLLM gets the group's whole TP
        assert _flag(vllm["args"], "--nnodes") == "2"
        assert _flag(vllm["args"], "--master-addr") == "$(LWS_LEADER_ADDRESS)"


def test_leader_serves_and_workers_run_headless_with_their_lws_rank() -> None:
    lws = _objects(_wide_decode())[("LeaderWorkerSet", "ds-decode")]["spec"]["leaderWorkerTemplate"]
    leader, worker = _vllm(lws["leaderTemplate"]), _vllm(lws["workerTemplate"])
    assert _flag(leader["args"], "--node-rank") == "0" and "--headless" not in leader["args"]
    assert (
        _flag(worker["args"], "--node-rank") == "$(LWS_WORKER_INDEX)" and worker["args"][-1] == "--headless"
    )
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(leader)
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(worker)  # no HTTP on a worker


def test_every_pod_of_a_group_is_one_engine_named_after_its_leader() -> None:
    lws = _objects(_wide_decode())[("LeaderWorkerSet", "ds-decode")]["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        vllm = _vllm(lws[key])
        kv = json.loads(_flag(vllm["args"], "--kv-transfer-config"))
        assert kv["engine_id"] == f"ds-decode-$({GROUP_INDEX_ENV})"  # the leader pod is <lws>-<group>
        assert kv["kv_connector_extra_config"]["side_channel_host"] == "$(POD_IP)"  # each rank's own pod
        env = {e["name"]: e for e in vllm["env"]}
        field = env[GROUP_INDEX_ENV]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == f"metadata.labels['{LABEL_GROUP_INDEX}']"


def test_the_router_finds_only_leaders_and_single_node_roles_are_unchanged() -> None:
    objs = _objects(_wide_decode())
    assert objs[("Service", "ds-decode")]["spec"]["selector"][LABEL_WORKER_INDEX] == "0"
    assert LABEL_WORKER_INDEX not in objs[("Service", "ds-prefill")]["spec"]["selector"]
    narrow = _objects(make_inference("ds", accelerator="p5en").decode(tensorParallelSize=8).obj())
    assert ("StatefulSet", "ds-decode") in narrow and ("LeaderWorkerSet", "ds-decode") not in narrow
    kv = json.loads(
        _flag(_vllm(narrow[("StatefulSet", "ds-decode")]["spec"]["template"])["args"], "--kv-transfer-config")
    )
    assert (
        kv["engine_id"] == "$(POD_NAME)"
        and "--nnodes" not in _vllm(narrow[("StatefulSet", "ds-decode")]["spec"]["template"])["args"]
    )
