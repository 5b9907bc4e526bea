"""Gang admission step (pure): spec.placement.gang + the API groups the cluster serves -> GangAdmitted.

A P/D service with prefill but no decode serves nothing, yet the scheduler places pods one by one. This
says, as a condition, whether the service's pods are admitted together, and if not, why: so a half-
started service is never silent.
"""

from __future__ import annotations

from kvferry.operator.render.placement import gang_group
from kvferry.operator.spec import Spec
from kvferry.operator.status.conditions import Reason, Verdict

KUEUE_GROUP = "kueue.x-k8s.io"  # Kueue's API (Workloads, LocalQueues)
COSCHEDULING_GROUP = "scheduling.x-k8s.io"  # scheduler-plugins' PodGroup (coscheduling)
GANG_GROUPS = (KUEUE_GROUP, COSCHEDULING_GROUP)


def verdict(spec: Spec, cr_name: str, served: set[str]) -> Verdict:
    """(status, reason, message) of GangAdmitted; `served`: which of GANG_GROUPS the API server serves."""
    installed = [g for g in GANG_GROUPS if g in served]
    if spec.placement.gang == "kueue":
        if KUEUE_GROUP not in served:
            return (
                "False",
                Reason.GANG_SCHEDULER_MISSING,
                "spec.placement.gang is kueue but the API server serves no kueue.x-k8s.io: nothing admits "
                "the pod group, so the scheduler places prefill and decode pods one by one",
            )
        return (
            "True",
            Reason.KUEUE_POD_GROUP,
            f"prefill and decode pods are Kueue pod group {gang_group(cr_name)} in LocalQueue "
            f"{spec.placement.queue_name}: admitted all together or not at all",
        )
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
