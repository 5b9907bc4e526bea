"""spec.autoscaling: what it accepts, and errors that name the field and say what is wrong."""

from __future__ import annotations

import pytest
from kvferry.operator.spec import RULES, SpecError, parse_spec

OWNED = {"prefill": {"replicasOwner": "autoscaler"}, "decode": {"replicasOwner": "autoscaler"}}
TARGETS = {"ttftSeconds": 1.5, "itlSeconds": 0.05}


def errors(autoscaling: dict, **spec: object) -> list[str]:
    with pytest.raises(SpecError) as exc:
        parse_spec({"model": "m", **OWNED, **spec, "autoscaling": autoscaling})
    return exc.value.errors


def test_targets_alone_get_the_documented_defaults() -> None:
    a = parse_spec({"model": "m", **OWNED, "autoscaling": TARGETS}).autoscaling
    assert a is not None
    assert (a.percentile, a.output, a.scale_down_stabilization_seconds) == ("p90", "scale", 300)
    assert (a.prefill.min_replicas, a.prefill.max_replicas) == (1, 4)
    assert a.ratio.min is None and a.ratio.max is None


def test_unset_autoscaling_is_off() -> None:
    assert parse_spec({"model": "m"}).autoscaling is None


def test_roles_must_be_owned_by_the_autoscaler() -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec({"model": "m", "autoscaling": TARGETS})
    assert exc.value.errors == [
        "spec.autoscaling: autoscaling needs prefill.replicasOwner and decode.replicasOwner set to "
        "autoscaler: the planner then owns both roles' replicas and spec replicas are only the "
        "starting size (docs/autoscaling.md)"
    ]


def test_targets_are_required_and_bounded() -> None:
    assert errors({"itlSeconds": 0, "percentile": "p99"}) == [
        "spec.autoscaling.ttftSeconds: required",
        "spec.autoscaling.itlSeconds: must be >= 0.0001 (got 0)",
        "spec.autoscaling.percentile: unsupported value 'p99', expected one of ['p50', 'p90']",
    ]


def test_bounds_that_cannot_hold_are_refused() -> None:
    found = errors({**TARGETS, "decode": {"minReplicas": 3, "maxReplicas": 2}, "ratio": {"min": 2, "max": 1}})
    assert "spec.autoscaling.decode.maxReplicas: autoscaling.decode.maxReplicas must be >= " in found[0]
    assert "spec.autoscaling.ratio.max: autoscaling.ratio.max must be >= autoscaling.ratio.min" in found


def test_a_ratio_the_replica_bounds_cannot_reach_is_refused() -> None:
    found = errors(
        {**TARGETS, "prefill": {"maxReplicas": 2}, "decode": {"minReplicas": 4}, "ratio": {"min": 1}}
    )
    assert found == [
        "spec.autoscaling.ratio.min: autoscaling.ratio.min cannot be met: prefill.maxReplicas / "
        "decode.minReplicas is below it"
    ]


def test_every_autoscaling_rule_has_cel_that_allows_an_unset_section() -> None:
    mine = [r for r in RULES if r.field_path.startswith(".autoscaling")]
    assert len(mine) == 6
    assert all(r.cel.startswith("!has(self.autoscaling) || ") for r in mine)
