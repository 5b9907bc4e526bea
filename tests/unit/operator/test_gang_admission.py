"""spec.placement.gang: both roles' pods as one Kueue pod group (labels and size), and the GangAdmitted
condition saying whether P and D are admitted together, and why not."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.operator.render import placement
from kvferry.operator.render.objects import render
from kvferry.operator.spec import SpecError, parse_spec
from kvferry.operator.status import admission
from kvferry.operator.status.conditions import ConditionType, Observed, Reason, summarize

from tests.unit.operator.cases import make_inference


def _pod_meta(cr: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for obj in render(cr).objects:
        if obj["kind"] == "StatefulSet":
            out[obj["metadata"]["name"]] = obj["spec"]["template"]["metadata"]
        elif obj["kind"] == "LeaderWorkerSet":
            out[obj["metadata"]["name"]] = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]
    return out


def test_kueue_gang_makes_every_engine_pod_one_group_of_the_right_size() -> None:
    cr = (
        make_inference("svc", accelerator="p5en", placement={"gang": "kueue", "queueName": "gpu"})
        .prefill(replicas=2)
        .decode(replicas=3, tensorParallelSize=16)  # 3 groups of 2 nodes
        .obj()
    )
    metas = _pod_meta(cr)
    assert set(metas) == {"svc-prefill", "svc-decode"}
    for meta in metas.values():
        assert meta["labels"][placement.KUEUE_QUEUE] == "gpu"
        assert meta["labels"][placement.KUEUE_GROUP] == "svc-engines"  # one group across both roles
        assert meta["annotations"][placement.KUEUE_TOTAL] == str(2 + 3 * 2)
        assert meta["annotations"][placement.KUEUE_SERVING] == "true"


def test_without_gang_no_kueue_keys_are_rendered() -> None:
    for meta in _pod_meta(make_inference("svc").obj()).values():
        assert not any(k.startswith("kueue.x-k8s.io/") for k in meta["labels"])
        assert "annotations" not in meta


def test_kueue_gang_needs_a_queue() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(make_inference("svc", placement={"gang": "kueue"}).obj()["spec"])
    assert err.value.errors[0].startswith("spec.placement.queueName:")


@pytest.mark.parametrize(
    ("gang", "served", "status", "reason"),
    [
        ({"gang": "none"}, set(), "False", Reason.NO_GANG_SCHEDULER),
        ({"gang": "none"}, {admission.KUEUE_GROUP}, "False", Reason.GANG_NOT_REQUESTED),
        ({"gang": "none"}, {admission.COSCHEDULING_GROUP}, "False", Reason.GANG_NOT_REQUESTED),
        ({"gang": "kueue", "queueName": "q"}, set(), "False", Reason.GANG_SCHEDULER_MISSING),
        (
            {"gang": "kueue", "queueName": "q"},
            {admission.COSCHEDULING_GROUP},
            "False",
            Reason.GANG_SCHEDULER_MISSING,
        ),
        ({"gang": "kueue", "queueName": "q"}, {admission.KUEUE_GROUP}, "False", Reason.KUEUE_PENDING),
    ],
)
def test_gang_admitted_says_whether_p_and_d_are_admitted_together(
    gang: dict[str, str], served: set[str], status: str, reason: Reason
) -> None:
    spec = parse_spec(make_inference("svc", placement=gang).obj()["spec"])
    got = admission.verdict(spec, "svc", served)  # no Workload read (yet)
    assert got[:2] == (status, reason)
    if reason is Reason.KUEUE_PENDING:
        assert "svc-engines" in got[2] and "no Workload" in got[2]


def _workload(**conditions: tuple[str, str]) -> dict[str, Any]:
    conds = [{"type": t, "status": s, "message": m} for t, (s, m) in conditions.items()]
    return {"kind": "Workload", "metadata": {"name": "svc-engines"}, "status": {"conditions": conds}}


QUOTA = "couldn't assign flavors to pod set a1b2: insufficient quota for nvidia.com/gpu in flavor gpus"


@pytest.mark.parametrize(
    ("workload", "status", "reason", "says"),
    [
        (
            _workload(QuotaReserved=("True", "ok"), Admitted=("True", "ok")),
            "True",
            Reason.KUEUE_ADMITTED,
            "released together",
        ),
        (_workload(QuotaReserved=("False", QUOTA)), "False", Reason.KUEUE_PENDING, QUOTA),
        (_workload(), "False", Reason.KUEUE_PENDING, "not admitted"),  # just made: no conditions yet
        (None, "False", Reason.KUEUE_PENDING, "no Workload"),
    ],
)
def test_with_kueue_the_condition_says_whether_the_group_was_admitted(
    workload: dict[str, Any] | None, status: str, reason: Reason, says: str
) -> None:
    spec = parse_spec(make_inference("svc", placement={"gang": "kueue", "queueName": "q"}).obj()["spec"])
    got = admission.verdict(spec, "svc", {admission.KUEUE_GROUP}, workload)
    assert got[:2] == (status, reason)
    assert says in got[2] and "svc-engines" in got[2] and "LocalQueue q" in got[2]


def test_the_condition_is_written_by_the_reconcile_and_carried_by_other_writers() -> None:
    kw: dict[str, Any] = dict(
        cr_name="svc",
        namespace="ns",
        generation=1,
        revision="r",
        desired={"prefill": 1, "decode": 1},
        router_replicas=1,
        now="t0",
    )
    gang = ("False", Reason.NO_GANG_SCHEDULER, "one by one")
    first = summarize(Observed(faults={}, gang=gang), previous={}, **kw)
    refreshed = summarize(Observed(), previous=first, **{**kw, "now": "t1"})  # a workload watch event
    for status in (first, refreshed):
        (cond,) = [c for c in status["conditions"] if c["type"] == ConditionType.GANG_ADMITTED.value]
        assert (cond["status"], cond["reason"], cond["lastTransitionTime"]) == (
            "False",
            "NoGangScheduler",
            "t0",
        )
