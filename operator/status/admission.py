"""Gang admission step (pure): spec.placement.gang + the API groups the cluster serves + the pod group's
Kueue Workload -> GangAdmitted.

A P/D service with prefill but no decode serves nothing, yet the scheduler places pods one by one. This
says, as a condition, whether the service's pods are admitted together, and if not, why: so a half-
started service is never silent. With Kueue it says which: admitted (every pod released at once) or
held (no pod of the group starts; Kueue's own reason, e.g. the quota it lacks, is quoted).
"""

from __future__ import annotations

from typing import Any

from kvferry.operator.render.placement import gang_group
from kvferry.operator.spec import Spec
from kvferry.operator.status.conditions import Reason, Verdict

KUEUE_GROUP = "kueue.x-k8s.io"  # Kueue's API (Workloads, LocalQueues)
COSCHEDULING_GROUP = "scheduling.x-k8s.io"  # scheduler-plugins' PodGroup (coscheduling)
GANG_GROUPS = (KUEUE_GROUP, COSCHEDULING_GROUP)


def _condition(workload: dict[str, Any], kind: str) -> dict[str, Any]:
    conds = (workload.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c.get("type") == kind), {})


def kueue_verdict(spec: Spec, cr_name: str, workload: dict[str, Any] | None) -> Verdict:
    """GangAdmitted from the pod group's Workload (Kueue names it after the group), or None: not made yet."""
    group, queue = gang_group(cr_name), spec.placement.queue_name
    if workload is None:
        return (
            "False",
            Reason.KUEUE_PENDING,
            f"Kueue holds the pods of group {group} (LocalQueue {queue}) and has made no Workload for it "
            "yet: it does once every pod of the group exists; no pod starts before the group is admitted",
        )
    admitted = _condition(workload, "Admitted")
    if admitted.get("status") == "True":
        return (
            "True",
            Reason.KUEUE_ADMITTED,
            f"Kueue admitted pod group {group} in LocalQueue {queue}: prefill and decode pods were "
            "released together",
        )
    why = _condition(workload, "QuotaReserved").get("message") or admitted.get("message") or "not admitted"
    return (
        "False",
        Reason.KUEUE_PENDING,
        f"Kueue has not admitted pod group {group} (LocalQueue {queue}), so no pod of it starts: {why}",
    )


def verdict(spec: Spec, cr_name: str, served: set[str], workload: dict[str, Any] | None = None) -> Verdict:
    """(status, reason, message) of GangAdmitted; `served`: which of GANG_GROUPS the API server serves;
    `workload`: the pod group's Kueue Workload as read (None when absent)."""
    installed = [g for g in GANG_GROUPS if g in served]
    if spec.placement.gang == "kueue":
        if KUEUE_GROUP not in served:
            return (
                "False",
                Reason.GANG_SCHEDULER_MISSING,
                "spec.placement.gang is kueue but the API server serves no kueue.x-k8s.io: nothing admits "
                "the pod group, so the scheduler places prefill and decode pods one by one",
            )
        return kueue_verdict(spec, cr_name, workload)
    if installed:
        return (
            "False",
            Reason.GANG_NOT_REQUESTED,
            f"the cluster serves {', '.join(installed)} but spec.placement.gang is none: pods are placed "
            "one by one, so one role may run without the other (set gang: kueue and queueName)",
        )
    return (
        "False",
        Reason.NO_GANG_SCHEDULER,
        "neither Kueue (kueue.x-k8s.io) nor scheduler-plugins coscheduling (scheduling.x-k8s.io) is "
        "installed: the scheduler places prefill and decode pods one by one, so one role may run without "
        "the other",
    )
