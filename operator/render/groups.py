"""Group step (pure): a role wider than one node runs as a leader + workers group per replica.

LeaderWorkerSet (sigs.k8s.io/lws) is the engine for this: one pod per node, created and restarted as a
group, each pod told the leader's address and its own index by LWS's pod webhook (LWS_LEADER_ADDRESS,
LWS_WORKER_INDEX, LWS_GROUP_SIZE). vLLM runs one engine across the group with its multiprocessing
backend: every pod runs `vllm serve` with `--nnodes`, `--node-rank` and the leader as `--master-addr`;
only the leader (node rank 0) serves HTTP, the workers run `--headless`.

The connector's ranks: vLLM numbers TP ranks across the group, so rank r serves its side channel on
`sideChannelPort + r` from the pod that holds it (`side_channel_host` is each pod's own IP). All pods
of a group share one engine id, the leader pod's name (`<lws>-<group index>`), so the group is one
engine to its peers and to the router, which reaches it through the leader only.
"""

from __future__ import annotations

import copy
from typing import Any

from kvferry.operator.spec import MAX_TP, Spec

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
# Labels LWS puts on every pod of a group (its API's constants).
LABEL_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LABEL_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_INDEX_ENV = "LWS_GROUP_INDEX"  # ours, from the label: names the leader pod in every pod
MASTER_PORT = 29501  # vLLM's default torch.distributed port on the leader (ParallelConfig.master_port)
HTTP_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def nodes_per_replica(spec: Spec, role: str) -> int:
    """1 for a role that fits one node; else the whole nodes its TP fills (rules.py checks divisibility)."""
    tp, per_node = getattr(spec, role).tensor_parallel_size, MAX_TP[spec.accelerator]
    return 1 if tp <= per_node else tp // per_node


def tp_per_pod(spec: Spec, role: str) -> int:
    return int(getattr(spec, role).tensor_parallel_size // nodes_per_replica(spec, role))


def engine_id(role_name: str) -> str:
    """The leader pod's name, expanded by the kubelet in every pod of the group."""
    return f"{role_name}-$({GROUP_INDEX_ENV})"


def group_env() -> list[dict[str, Any]]:
    label = f"metadata.labels['{LABEL_GROUP_INDEX}']"
    return [{"name": GROUP_INDEX_ENV, "valueFrom": {"fieldRef": {"fieldPath": label}}}]


def node_args(nodes: int, leader: bool) -> list[str]:
    """vLLM's multi-node flags for one pod of a group of `nodes`."""
    rank = "0" if leader else "$(LWS_WORKER_INDEX)"
    args = ["--nnodes", str(nodes), "--node-rank", rank, "--master-addr", "$(LWS_LEADER_ADDRESS)"]
    args += ["--master-port", str(MASTER_PORT)]
    return args if leader else [*args, "--headless"]


def pod_templates(template: dict[str, Any], nodes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(leader, worker) pod templates from the StatefulSet's single-node pod template."""
    leader, worker = copy.deepcopy(template), copy.deepcopy(template)
    for pod, is_leader in ((leader, True), (worker, False)):
        (vllm,) = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
        vllm["args"] = [*vllm["args"], *node_args(nodes, is_leader)]
        vllm["env"] = [*group_env(), *vllm["env"]]
        if not is_leader:  # a headless worker serves no HTTP: the group restarts when one dies
            for probe in HTTP_PROBES:
                vllm.pop(probe, None)
    return leader, worker


def context(statefulset: dict[str, Any], nodes: int) -> dict[str, Any]:
    """What templates/leaderworkerset.yaml.j2 needs, taken from the role's rendered StatefulSet."""
    leader, worker = pod_templates(statefulset["spec"]["template"], nodes)
    return {
        "metadata": statefulset["metadata"],
        "replicas": statefulset["spec"].get("replicas"),
        "size": nodes,
        "leader": leader,
        "worker": worker,
    }
