"""Gang observation (I/O): what the cluster says about a service's gang admission -> GangAdmitted.

Discovery says which gang APIs are served (cached by Kube); with `gang: kueue` and Kueue served, the pod
group's Workload is read too (one GET: Kueue names it after the group), so the condition says whether
Kueue admitted the group or holds it. The reconcile calls this, and so does the metrics timer, because
admission changes nothing the operator watches while the group waits for quota.
"""

from __future__ import annotations

from typing import Any

from kvferry.operator.reconcile.apply import Kube, KubeError
from kvferry.operator.render.placement import gang_group
from kvferry.operator.spec import Spec, SpecError, parse_spec
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


def observe_if_kueue(kube: Kube, cr: dict[str, Any]) -> Verdict | None:
    """For the timer: the verdict of a `gang: kueue` CR, else None (the reconcile's stays)."""
    raw = cr.get("spec") or {}
    if (raw.get("placement") or {}).get("gang") != "kueue":
        return None
    try:
        spec = parse_spec(raw)
    except SpecError:
        return None  # the reconcile reports invalid specs
    meta = cr["metadata"]
    return observe(kube, spec, meta["namespace"], meta["name"])
