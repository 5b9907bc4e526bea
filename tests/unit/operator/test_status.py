"""status.summarize and set_condition: generation-aware readiness, flips-only transition times."""

from __future__ import annotations

from kvferry.operator.spec import names
from kvferry.operator.status.conditions import (
    ConditionType,
    Observed,
    Reason,
    condition,
    set_condition,
    summarize,
)


def _sts(rev: str, desired: int, ready: int, updated: int | None = None, gen: int = 1, seen: int = 1) -> dict:
    updated = desired if updated is None else updated
    return {
        "metadata": {"generation": gen},
        "spec": {"replicas": desired, "template": {"metadata": {"labels": {names.LABEL_REVISION: rev}}}},
        "status": {
            "observedGeneration": seen,
            "replicas": desired,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "currentRevision": "a",
            "updateRevision": "a",
        },
    }


def _router(ready: int) -> dict:
    return {
        "metadata": {"generation": 1},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": ready, "updatedReplicas": 1},
    }


def _summarize(observed: Observed, previous: dict | None = None, gen: int = 3, now: str = "t1") -> dict:
    return summarize(
        observed,
        cr_name="x",
        namespace="ns",
        generation=gen,
        revision="r1",
        desired={"prefill": 1, "decode": 2},
        router_replicas=1,
        previous=previous or {},
        now=now,
    )


def test_ready_only_when_every_role_is_on_the_current_revision() -> None:
    ok = Observed({"prefill": _sts("r1", 1, 1), "decode": _sts("r1", 2, 2)}, _router(1))
    status = _summarize(ok)
    assert condition(status, ConditionType.READY)["status"] == "True"
    assert condition(status, ConditionType.PROGRESSING)["status"] == "False"
    assert status["decode"]["summary"] == "2/2" and status["observedGeneration"] == 3
    old = Observed({"prefill": _sts("r0", 1, 1), "decode": _sts("r1", 2, 2)}, _router(1))
    status = _summarize(old)
    assert condition(status, ConditionType.READY)["status"] == "False"
    assert condition(status, ConditionType.PROGRESSING)["reason"] == "RollingOut"


def test_unobserved_statefulset_generation_is_not_ready() -> None:
    lagging = Observed({"prefill": _sts("r1", 1, 1, gen=2, seen=1), "decode": _sts("r1", 2, 2)}, _router(1))
    assert condition(_summarize(lagging), ConditionType.READY)["status"] == "False"


def test_apply_failure_is_degraded_and_conditions_carry_generation() -> None:
    status = _summarize(Observed({}, None, faults={Reason.APPLY_FAILED: "403 forbidden"}), gen=7)
    degraded = condition(status, ConditionType.DEGRADED)
    assert (degraded["status"], degraded["reason"], degraded["observedGeneration"]) == (
        "True",
        "ApplyFailed",
        7,
    )


def test_transition_time_moves_only_on_a_flip() -> None:
    conds = set_condition([], ConditionType.READY, "False", *_reason(), 1, "t0")
    conds = set_condition(conds, ConditionType.READY, "False", *_reason(), 2, "t1")
    assert conds[0]["lastTransitionTime"] == "t0" and conds[0]["observedGeneration"] == 2
    conds = set_condition(conds, ConditionType.READY, "True", *_reason(), 2, "t2")
    assert conds[0]["lastTransitionTime"] == "t2"


def test_transfer_unhealthy_makes_degraded() -> None:
    previous = {
        "conditions": [
            {
                "type": "TransferHealthy",
                "status": "False",
                "reason": "UCXOnEFA",
                "message": "m",
                "lastTransitionTime": "t0",
            }
        ]
    }
    ok = Observed({"prefill": _sts("r1", 1, 1), "decode": _sts("r1", 2, 2)}, _router(1))
    status = _summarize(ok, previous)
    assert condition(status, ConditionType.DEGRADED)["reason"] == "TransferUnhealthy"
    assert condition(status, ConditionType.TRANSFER_HEALTHY)["lastTransitionTime"] == "t0"


def _reason():
    from kvferry.operator.status.conditions import Reason

    return Reason.PODS_NOT_READY, "msg"
