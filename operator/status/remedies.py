"""Remedies step: for every condition reason, what a person should do (pure).

Appended to TransferHealthy messages so `kubectl describe disaggregatedinference NAME` says what to fix,
and the source of docs/troubleshooting.md's checklist (tests/unit/operator/test_operability_remedies.py
checks every Reason has an entry in both places).
"""

from __future__ import annotations

from kvferry.contracts.metrics import CHECK_MEMLOCK, CHECK_NCCL_NET
from kvferry.operator.status.conditions import Reason

FIXES: dict[Reason, str] = {
    Reason.ALL_READY: "nothing to do",
    Reason.RECONCILED: "nothing to do",
    Reason.TRANSFERS_OK: "nothing to do",
    Reason.ROLLING_OUT: "wait; `kubectl rollout status statefulset/NAME-prefill` shows progress",
    Reason.SCALING: "wait; pods are being added or removed",
    Reason.PODS_NOT_READY: (
        "`kubectl describe pod` the engine pods: model still loading (startup probe), image pull, "
        "unschedulable (EFA/GPU resources), or a crash"
    ),
    Reason.ROUTER_NOT_READY: "`kubectl logs deploy/NAME-router`: discovery RBAC or config errors",
    Reason.OBJECTS_MISSING: "wait one reconcile; if it persists, read the operator log",
    Reason.INVALID_SPEC: "correct the field the message names (kubectl explain disaggregatedinference.spec)",
    Reason.APPLY_FAILED: "read the API error in the message: RBAC of the operator, quota, or admission",
    Reason.SECRET_MISSING: "create the Secret the message names in the CR's namespace",
    Reason.CONFLICT: (
        "an object the message names exists and belongs to someone else: the operator leaves it alone; "
        "delete or rename it, or rename the DisaggregatedInference"
    ),
    Reason.TRANSFER_UNHEALTHY: "see the TransferHealthy condition's reason",
    Reason.NO_TRAFFIC: "send a request through the router endpoint (status.endpoint)",
    Reason.TRANSFER_FAILURES: (
        "check the failure reason in status.transfer.lastFailure; deadline/lease_expired: raise "
        "kvTransfer.deadlineSeconds/leaseSeconds or add decode pods; handshake_failed: side-channel port "
        "blocked (NetworkPolicy, security groups)"
    ),
    Reason.LAYOUT_MISMATCH: (
        "prefill and decode store KV in layouts kvferry cannot map (dtype, head size, layer count, "
        "kvCacheDtype or model differ): the engine log line 'kvferry: layout mismatch' names both; run "
        "both roles with the same model, dtype and KV cache dtype"
    ),
    Reason.SAMPLE_MISMATCH: (
        'decode\'s KV did not hold what prefill sent (kvferry_sentinel_checks_total{result="mismatch"}); '
        "those requests were recomputed, not served wrong: compare the two roles' images, model flags and "
        "kvCacheDtype, and report the engine logs' 'is not what it sent' lines"
    ),
    Reason.WRONG_BACKEND: (
        "set spec.kvTransfer.backends to [LIBFABRIC] (or leave it empty for the EFA preset's) and remove "
        "any backends override from the image or extraArgs"
    ),
    Reason.DECODE_RECOMPUTES: (
        "KV is not arriving: check TransferFailures, that prefill and decode share a revision, and the "
        "router mode; kvTransfer.loadFailurePolicy recompute hides failed loads"
    ),
    Reason.METRICS_UNAVAILABLE: (
        "the operator cannot read the engines' /metrics: pods not Running, a NetworkPolicy blocking the "
        "operator, or an operator KVFERRY_METRICS_URL that does not point at the pods"
    ),
    Reason.PREFLIGHT_FAILED: (
        "use a vLLM image whose vLLM and NIXL the connector supports (spec.image; vLLM >= 0.32, "
        "NIXL >= 1.5, the backend plugin present), or kvTransfer.connectorSource image with kvferry's image"
    ),
    Reason.IMAGE_PULL_FAILED: (
        "the image the message names does not exist or needs credentials: build and push the images "
        "(docs/install.md, `docker buildx bake`) and install with image.registry set to that registry, or "
        "set spec.image; for a private registry add spec.<role>.imagePullSecrets"
    ),
    Reason.INJECT_FAILED: (
        "the init container could not copy the connector: check the operator image (spec.router.image) "
        "and `kubectl logs POD -c kvferry-inject`"
    ),
    Reason.KUEUE_ADMITTED: "nothing to do; `kubectl get workloads` shows the pod group's admission",
    Reason.KUEUE_PENDING: (
        "give the LocalQueue's ClusterQueue quota for the whole service (both roles), or lower replicas; "
        "`kubectl describe workload NAME-engines` shows what Kueue waits for"
    ),
    Reason.GANG_SCHEDULER_MISSING: (
        'install Kueue with its pod integration (docs/install.md "Gang admission"), or set '
        "spec.placement.gang none"
    ),
    Reason.GANG_NOT_REQUESTED: "set spec.placement.gang kueue and queueName to a LocalQueue of the namespace",
    Reason.NO_GANG_SCHEDULER: (
        'install Kueue to admit prefill and decode together (docs/install.md "Gang admission"); until '
        "then watch both roles' readiness (kubectl get disaggregatedinference)"
    ),
}
# PreflightFailed names the failed checks; these have a fix of their own, added when named.
CHECK_FIXES = {
    CHECK_MEMLOCK: (
        "memlock: run the engine as UID 0 with IPC_LOCK (the EFA presets do; the none preset keeps the "
        "image's user) or give containerd LimitMEMLOCK=infinity on the nodes (docs/eks.md, memory locking)"
    ),
    CHECK_NCCL_NET: (
        "nccl_net: use an engine image with aws-ofi-nccl on LD_LIBRARY_PATH and NCCL_NET_PLUGIN=ofi "
        "(images/vllm/Dockerfile), on nodes with EFA devices (docs/eks.md)"
    ),
    "efa_device": (
        "efa_device: install the EFA device plugin with tolerations for the GPU taint (docs/eks.md)"
    ),
}
HEALTHY = {Reason.ALL_READY, Reason.RECONCILED, Reason.TRANSFERS_OK, Reason.KUEUE_ADMITTED}


def explain(reason: Reason, message: str) -> str:
    """`message` plus what to do about it (unchanged for healthy reasons)."""
    if reason in HEALTHY or reason not in FIXES:
        return message
    fixes = [FIXES[reason]]
    if reason is Reason.PREFLIGHT_FAILED:
        fixes += [fix for check, fix in CHECK_FIXES.items() if f" {check}" in message]
    return f"{message}. Fix: {'; '.join(fixes)}"


# Conditions each non-TransferHealthy reason can appear on (status.conditions).
_CONDITIONS = {
    Reason.ALL_READY: "Ready",
    Reason.RECONCILED: "Progressing, Degraded",
    Reason.INVALID_SPEC: "Ready, Progressing, Degraded",
    Reason.APPLY_FAILED: "Ready, Progressing, Degraded",
    Reason.CONFLICT: "Ready, Progressing, Degraded",
    Reason.TRANSFER_UNHEALTHY: "Degraded",
    Reason.SECRET_MISSING: "Degraded",
    **{
        r: "GangAdmitted"
        for r in (
            Reason.KUEUE_ADMITTED,
            Reason.KUEUE_PENDING,
            Reason.GANG_SCHEDULER_MISSING,
            Reason.GANG_NOT_REQUESTED,
            Reason.NO_GANG_SCHEDULER,
        )
    },
    **{
        r: "Ready, Progressing"
        for r in (
            Reason.ROLLING_OUT,
            Reason.SCALING,
            Reason.PODS_NOT_READY,
            Reason.ROUTER_NOT_READY,
            Reason.OBJECTS_MISSING,
        )
    },
}


def condition_types(reason: Reason) -> str:
    """Which conditions may carry `reason` (the rest are TransferHealthy's, set by the metrics timer)."""
    return _CONDITIONS.get(reason, "TransferHealthy")


def table() -> str:
    """The reason table of docs/troubleshooting.md (`python -m kvferry.operator.status.remedies`)."""
    rows = ["| reason | condition | what to do |", "|---|---|---|"]
    rows += [f"| `{r.value}` | {condition_types(r)} | {FIXES[r]} |" for r in Reason]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
