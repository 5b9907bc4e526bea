"""Prefill and decode on different accelerator presets (spec.<role>.accelerator): each role's pods get
their own preset's node type and devices; only presets of one family (p5en with p5), and only with the
kvferry connector; the Python twins refuse what the CRD's CEL refuses (cases.py, on the API server in
tests/cluster/test_operator_validation.py)."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.operator.render.objects import render
from kvferry.operator.spec import SpecError, parse_spec

from tests.unit.operator.cases import make_inference

INSTANCE = "node.kubernetes.io/instance-type"


def _pod_specs(cr: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["labels"]["kvferry.io/role"]: o["spec"]["template"]["spec"]
        for o in render(cr).objects
        if o["kind"] == "StatefulSet"
    }


def test_each_role_runs_on_its_own_preset() -> None:
    pods = _pod_specs(make_inference("svc", accelerator="p5en").decode(accelerator="p5").obj())
    assert pods["prefill"]["nodeSelector"][INSTANCE] == "p5en.48xlarge"
    assert pods["decode"]["nodeSelector"][INSTANCE] == "p5.48xlarge"
    spec = parse_spec(make_inference("svc", accelerator="p5").prefill(accelerator="p5en").obj()["spec"])
    assert (spec.role_accelerator("prefill"), spec.role_accelerator("decode")) == ("p5en", "p5")


def test_a_role_on_the_services_own_preset_changes_nothing() -> None:
    plain = render(make_inference("svc", accelerator="p5en").obj()).objects
    same = render(make_inference("svc", accelerator="p5en").decode(accelerator="p5en").obj()).objects
    strip = [o for o in same if o["kind"] != "ConfigMap"]  # the ConfigMap carries the spec as written
    assert [o for o in plain if o["kind"] != "ConfigMap"] == strip


@pytest.mark.parametrize(
    ("cr", "field"),
    [
        (
            make_inference("a", accelerator="p5en").prefill(accelerator="cpu").obj(),
            "spec.prefill.accelerator",
        ),
        (make_inference("b", accelerator="trn2").decode(accelerator="trn1").obj(), "spec.decode.accelerator"),
        (make_inference("c", accelerator="cpu").decode(accelerator="none").obj(), "spec.decode.accelerator"),
        (
            make_inference("d", accelerator="p5").kv(connector="vllm").prefill(accelerator="p5en").obj(),
            "spec.kvTransfer.connector",
        ),
    ],
)
def test_mixes_the_connector_cannot_map_are_refused(cr: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(cr["spec"])
    assert any(e.startswith(field) for e in err.value.errors), err.value.errors
