"""spec.placement -> pod affinity: both roles get the same terms over every engine pod of the CR, after the
user's own; the user's affinity is never replaced."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.operator.render.objects import render
from kvferry.operator.render.placement import NETWORK_LAYERS, PREFERRED, REQUIRED, ZONE
from kvferry.operator.spec import SpecError

from tests.unit.operator.cases import make_inference

USER_AFFINITY = {
    "nodeAffinity": {
        REQUIRED: {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]
        }
    },
    "podAntiAffinity": {
        PREFERRED: [{"weight": 7, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]
    },
    "podAffinity": {REQUIRED: [{"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": ZONE}]},
}


def _pod_spec(cr: dict[str, Any], role: str) -> dict[str, Any]:
    (sts,) = [
        o
        for o in render(cr).objects
        if o["kind"] == "StatefulSet" and o["metadata"]["labels"]["kvferry.io/role"] == role
    ]
    return sts["spec"]["template"]["spec"]


def _keys(terms: list[dict[str, Any]]) -> list[str]:
    return [t.get("podAffinityTerm", t)["topologyKey"] for t in terms]


def test_efa_presets_prefer_one_zone_and_close_network_nodes_by_default() -> None:
    cr = make_inference("q", accelerator="p5en").obj()
    for role in ("prefill", "decode"):
        pod = _pod_spec(cr, role)["affinity"]["podAffinity"]
        assert REQUIRED not in pod
        assert _keys(pod[PREFERRED]) == [ZONE, *(key for key, _ in NETWORK_LAYERS)]
        weights = [t["weight"] for t in pod[PREFERRED]]
        assert weights[1] > weights[2] > weights[3]  # the bottom layer (fewest hops) counts most
        selector = pod[PREFERRED][0]["podAffinityTerm"]["labelSelector"]
        assert selector["matchLabels"] == {"kvferry.io/name": "q"}
        assert selector["matchExpressions"] == [
            {"key": "kvferry.io/role", "operator": "In", "values": ["prefill", "decode"]}
        ]


def test_cpu_preset_renders_no_affinity_unless_asked() -> None:
    assert "affinity" not in _pod_spec(make_inference("c").obj(), "decode")
    cr = make_inference("c", placement={"sameZone": "required"}).obj()
    pod = _pod_spec(cr, "decode")["affinity"]["podAffinity"]
    assert _keys(pod[REQUIRED]) == [ZONE] and PREFERRED not in pod


def test_required_zone_is_a_hard_term_and_none_turns_everything_off() -> None:
    cr = make_inference("q", accelerator="p5en", placement={"sameZone": "required"}).obj()
    pod = _pod_spec(cr, "prefill")["affinity"]["podAffinity"]
    assert _keys(pod[REQUIRED]) == [ZONE]
    assert ZONE not in _keys(pod[PREFERRED])
    off = make_inference("q", accelerator="p5en", placement={"sameZone": "none", "networkTopology": "none"})
    assert "affinity" not in _pod_spec(off.obj(), "prefill")


def test_the_users_affinity_is_kept_and_comes_first() -> None:
    cr = (
        make_inference("q", accelerator="p5en", placement={"sameZone": "required"})
        .prefill(affinity=USER_AFFINITY)
        .obj()
    )
    affinity = _pod_spec(cr, "prefill")["affinity"]
    assert affinity["nodeAffinity"] == USER_AFFINITY["nodeAffinity"]
    assert affinity["podAntiAffinity"] == USER_AFFINITY["podAntiAffinity"]
    required = affinity["podAffinity"][REQUIRED]
    assert required[0] == USER_AFFINITY["podAffinity"][REQUIRED][0]
    assert _keys(required) == [ZONE, ZONE] and required[1]["labelSelector"]["matchLabels"] == {
        "kvferry.io/name": "q"
    }
    assert cr["spec"]["prefill"]["affinity"] == USER_AFFINITY  # the input is not mutated
    # decode has no user affinity: only the policy's terms
    assert _keys(_pod_spec(cr, "decode")["affinity"]["podAffinity"][REQUIRED]) == [ZONE]


@pytest.mark.parametrize(
    ("affinity", "path"),
    [
        ({"podAffinity": []}, "spec.decode.affinity.podAffinity"),
        ({"podAffinity": {PREFERRED: {"weight": 1}}}, f"spec.decode.affinity.podAffinity.{PREFERRED}"),
    ],
)
def test_a_malformed_user_pod_affinity_is_an_error_naming_it(affinity: dict[str, Any], path: str) -> None:
    cr = make_inference("q", accelerator="p5en").decode(affinity=affinity).obj()
    with pytest.raises(SpecError) as err:
        render(cr)
    assert err.value.errors[0].startswith(f"{path}: expected")


@pytest.mark.parametrize(
    ("placement", "path"),
    [
        ({"sameZone": "always"}, "spec.placement.sameZone"),
        ({"networkTopology": "required"}, "spec.placement.networkTopology"),
        ({"rack": "x"}, "spec.placement.rack"),
    ],
)
def test_an_unknown_policy_is_refused_naming_the_field(placement: dict[str, Any], path: str) -> None:
    with pytest.raises(SpecError) as err:
        render(make_inference("q", placement=placement).obj())
    assert any(e.startswith(f"{path}:") for e in err.value.errors), err.value.errors
