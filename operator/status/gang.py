"""Gang observation (I/O): what the cluster says about a service's gang admission -> GangAdmitted.

Discovery says which gang APIs are served (cached by Kube); with `gang: kueue` and Kueue served, the pod
group's Workload is read too (one GET: Kueue names it after the group), so the condition says whether
Kueue admitted the group or holds it. The reconcile calls this, and so does the metrics timer, because
admission changes nothing the operator watches while the group waits for quota.
"""

from __future__ import annotations

from kvferry.operator.reconcile.apply import Kube, KubeError
from kvferry.operator.render.placement import gang_group
from kvferry.operator.spec import Inference, Spec
from kvferry.operator.status import admission
from kvferry.operator.status.conditions import Reason, Verdict


def observe(kube: Kube, spec: Spec, namespace: str, cr_name: str) -> Verdict:
    try:
        served = {group for group in admission.GANG_GROUPS if kube.serves(group)}
        workload = None
        if spec.placement.gang == "kueue" and admission.KUEUE_GROUP in served:
            workload = kube.get("Workload", namespace, gang_group(cr_name))
        return admission.verdict(spec, cr_name, served, workload)
    except KubeError as exc:
        return ("Unknown", Reason.NO_GANG_SCHEDULER, f"cannot read gang admission: {exc}")


def observe_if_kueue(kube: Kube, cr: Inference) -> Verdict | None:
    """For the timer: the verdict of a `gang: kueue` CR, else None (the reconcile's stays, and the
    reconcile reports an invalid spec)."""
    if not cr.valid or cr.spec.placement.gang != "kueue":
        return None
    return observe(kube, cr.spec, cr.meta.namespace, cr.meta.name)
