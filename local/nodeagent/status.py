"""Report step: pod status (phase, IPs, conditions, containerStatuses) and the Node's heartbeat.

The pod status is written as a JSON merge patch of the whole status section, the way the kubelet
owns it; the PodScheduled condition the scheduler wrote is carried over. The Node gets a Ready
condition and its Lease in kube-node-lease renewed, so the node-lifecycle controller keeps it Ready
(and keeps the not-ready taint off), as it would for a kubelet.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from kvferry.local.nodeagent import cgroups
from kvferry.local.nodeagent.kube import Kube, KubeError
from kvferry.local.nodeagent.runner import ContainerRunner, now_iso

LEASE_DURATION_S = 40


def _condition(kind: str, ok: bool, since: dict[str, str], reason: str = "") -> dict[str, Any]:
    cond = {
        "type": kind,
        "status": "True" if ok else "False",
        "lastTransitionTime": since.get(kind, now_iso()),
    }
    if reason and not ok:
        cond["reason"] = reason
    return cond


def pod_phase(runners: list[ContainerRunner], restart_policy: str, failed_setup: bool) -> str:
    """Pending until a container ran; Succeeded/Failed only when nothing will restart."""
    if failed_setup:
        return "Failed"
    if any(r.running for r in runners):
        return "Running"
    if runners and all(r.last is not None and not r.wants_restart() for r in runners):
        return "Succeeded" if all(r.finished_ok for r in runners) else "Failed"
    if any(r.last is not None for r in runners):
        return "Running"  # restarting between attempts: the kubelet keeps the phase Running
    return "Pending"


def limit_condition(runners: list[ContainerRunner], since: dict[str, str]) -> dict[str, Any] | None:
    """`kvferry.io/CPULimitEnforced` for a pod with a CPU limit: True when every limited container
    runs in its cgroup, False (reason CgroupUnavailable, the why in the message) otherwise."""
    limited = [r for r in runners if r.cgroup is not None or r.limit_note]
    if not limited:
        return None
    ok = all(r.cgroup is not None for r in limited)
    notes = [r.limit_note for r in limited if r.limit_note]
    enforced = [f"{r.plan.name}: {r.cgroup.millicores}m" for r in limited if r.cgroup is not None]
    key = f"_{cgroups.CONDITION}"
    if since.get(key) != str(ok):
        since[key], since[cgroups.CONDITION] = str(ok), now_iso()
    cond = _condition(cgroups.CONDITION, ok, since, "CgroupUnavailable")
    cond["message"] = "; ".join(notes) if notes else "CFS quota on " + ", ".join(enforced)
    return cond


def pod_status(
    pod: dict[str, Any],
    runners: list[ContainerRunner],
    pod_ip: str,
    host_ip: str,
    start_time: str,
    since: dict[str, str],
    message: str = "",
) -> dict[str, Any]:
    """The whole status section; `since` keeps each condition's lastTransitionTime (updated here)."""
    policy = pod["spec"].get("restartPolicy", "Always")
    phase = pod_phase(runners, policy, failed_setup=bool(message))
    ready = bool(runners) and all(r.ready for r in runners) and phase == "Running"
    flags = {
        "Initialized": not message,
        "ContainersReady": ready,
        "Ready": ready,
        "PodReadyToStartContainers": True,
    }
    for kind, ok in flags.items():
        key = f"{kind}={ok}"
        if since.get(f"_{kind}") != key:
            since[f"_{kind}"], since[kind] = key, now_iso()
    conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"]
    conditions += [_condition(k, ok, since, "ContainersNotReady") for k, ok in flags.items()]
    limit = limit_condition(runners, since)
    if limit is not None:
        conditions.append(limit)
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        "qosClass": (pod.get("status") or {}).get("qosClass", "BestEffort"),
        "containerStatuses": [r.status() for r in runners],
    }
    if message:
        status["message"], status["reason"] = message, "LocalSetupFailed"
    return status


def write_pod_status(kube: Kube, pod: dict[str, Any], status: dict[str, Any]) -> None:
    meta = pod["metadata"]
    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
    # The uid precondition keeps a status meant for a deleted pod off its same-named successor.
    kube.merge_patch(path, {"metadata": {"uid": meta["uid"]}, "status": status})


def _micro_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def heartbeat_node(kube: Kube, node: str, host_ip: str, ready_since: str) -> None:
    """Renew the node's Lease and set its Ready condition (one call each, bounded)."""
    _renew_lease(kube, node)
    now = now_iso()
    conditions = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kvferry local node agent is posting ready status",
            "lastHeartbeatTime": now,
            "lastTransitionTime": ready_since,
        }
    ]
    conditions += [
        {"type": t, "status": "False", "reason": f"KubeletHas{r}", "lastHeartbeatTime": now,
         "lastTransitionTime": ready_since}
        for t, r in (("MemoryPressure", "SufficientMemory"), ("DiskPressure", "NoDiskPressure"),
                     ("PIDPressure", "SufficientPID"))
    ]  # fmt: skip
    status = {
        "conditions": conditions,
        "addresses": [{"type": "InternalIP", "address": host_ip}, {"type": "Hostname", "address": node}],
        "nodeInfo": {"kubeletVersion": "kvferry-local", "operatingSystem": "linux", "architecture": "amd64"},
    }
    kube.request(
        "PATCH",
        f"/api/v1/nodes/{node}/status",
        {"status": status},
        content_type="application/strategic-merge-patch+json",
    )


def _renew_lease(kube: Kube, node: str) -> None:
    path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}"
    spec = {"holderIdentity": node, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": _micro_now()}
    try:
        kube.merge_patch(path, {"spec": spec})
    except KubeError as exc:
        if exc.status != 404:
            raise
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": node},
            "spec": spec,
        }
        kube.request("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", body)
