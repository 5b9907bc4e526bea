"""What a CR hands into its pods is bounded before the operator uses it: resource quantities (a huge
exponent costs nothing anywhere), the engine's identity env, image references (digests allowed)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from kvferry.operator.reconcile.drift import is_subset, quantity
from kvferry.operator.render.objects import render
from kvferry.operator.spec import SpecError, parse_spec
from kvferry.operator.spec.podinputs import RESERVED_ENV
from kvferry.operator.spec.quantity import INT64_MAX, spec_quantity

from tests.unit.operator.hostile_cases import DIGEST, HOSTILE_INVALID, HOSTILE_VALID

NANO = Fraction(1, 10**9)


def test_quantity_refuses_huge_exponents_instead_of_computing_them() -> None:
    # 10**1000000 took half a second; 10**999999999 would take hours and ~415 MB.
    for text in ("10e1000000", "1e999999999", "1e-999999999", "1e2147483647", "9" * 200, "1e" + "9" * 70):
        assert quantity(text) is None, text
    assert quantity("1e100") == 10**100  # the bound itself is still exact


def test_quantity_rounds_and_caps_as_kubernetes_does() -> None:
    # apimachinery ParseQuantity: non-zero values round up to 1n, binary suffixes cap at 2^63-1
    assert quantity("0.1n") == quantity("1n") == NANO
    assert quantity("1e-50") == NANO and quantity("0") == 0 and quantity("0e-50") == 0
    assert quantity("9Ei") == quantity("9223372036854775807Ki") == INT64_MAX
    assert quantity("5120Mi") == quantity("5Gi") and quantity("1000m") == quantity("1") == quantity(1)
    assert quantity("1.5Gi") == 1610612736 and quantity("1e3") == quantity("1k")
    assert quantity(True) is None and quantity("1.5.5") is None and quantity("Gi") is None


def test_spec_quantities_are_the_bounded_subset() -> None:
    ok = [4, 0, "500m", "1.5Gi", "1e3", "1E-3", ".5", "16Gi", "100", "10G"]
    bad = [-1, True, "-1", "+1", "10e1000000", "1e100", "1" * 19, "1.0000000001", "1Gi1", "", "1 Gi", 2**63]
    assert [v for v in ok if not spec_quantity(v)] == []
    assert [v for v in bad if spec_quantity(v)] == []


def test_drift_compare_with_a_hostile_value_is_instant_and_says_drifted() -> None:
    desired = {"resources": {"limits": {"cpu": "1e999999999"}}}
    assert not is_subset(desired, {"resources": {"limits": {"cpu": "1e999999999"[:5]}}})
    assert is_subset(
        {"resources": {"limits": {"memory": "5120Mi"}}}, {"resources": {"limits": {"memory": "5Gi"}}}
    )


@pytest.mark.parametrize(("case", "cr", "field"), HOSTILE_INVALID, ids=[c[0] for c in HOSTILE_INVALID])
def test_hostile_inputs_are_refused_naming_the_field(case: str, cr: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(cr["spec"], cr["metadata"]["name"])
    assert any(e.startswith(field) for e in err.value.errors), err.value.errors


@pytest.mark.parametrize("case", sorted(HOSTILE_VALID))
def test_bounded_inputs_are_accepted_and_rendered_as_given(case: str) -> None:
    cr = {**HOSTILE_VALID[case], "metadata": {**HOSTILE_VALID[case]["metadata"], "namespace": "ns"}}
    rendered = render(cr)
    images = {
        c["image"]
        for o in rendered.objects
        if o["kind"] in ("StatefulSet", "Deployment")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    if case == "image-by-digest":
        assert f"registry.example.com:5000/team/vllm@{DIGEST}" in images
        assert f"kvferry/operator:0.1.0@{DIGEST}" in images


def test_render_refuses_the_hostile_cpu_before_anything_compares_it() -> None:
    cr = dict(HOSTILE_INVALID[0][1], metadata={"name": "hq1", "namespace": "ns"})
    with pytest.raises(SpecError, match="spec.prefill.resources"):
        render(cr)


def test_reserved_env_is_the_identity_render_sets() -> None:
    """The refused names are exactly the ones render gives the engine container before the user's env
    (a later entry of the same name would win in Kubernetes)."""
    cr = {**HOSTILE_VALID["env-of-other-names"], "metadata": {"name": "hv3", "namespace": "ns"}}
    sts = next(
        o for o in render(cr).objects if (o["kind"], o["metadata"]["name"]) == ("StatefulSet", "hv3-decode")
    )
    env = [e["name"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert tuple(env[: len(RESERVED_ENV)]) == RESERVED_ENV
    assert env.count("POD_IP") == 1 and "POD_IP_FAMILY" in env
