"""pd_ab: variants named on the command line, the host's steal share, and the ratios to pull per round."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("pd_ab", Path(__file__).parents[3] / "bench" / "pd_ab.py")
assert _spec is not None and _spec.loader is not None
pd_ab = importlib.util.module_from_spec(_spec)
sys.modules["pd_ab"] = pd_ab  # its dataclasses look their module up
_spec.loader.exec_module(pd_ab)


def test_a_variant_carries_connector_and_router_overrides() -> None:
    v = pd_ab.parse_variant('poll={"connector": {"poll_min_s": 0.002}, "router": {"streaming": {}}}')
    assert (v.name, v.mode) == ("poll", "kvferry")
    assert (v.connector, v.router) == ({"poll_min_s": 0.002}, {"streaming": {}})


@pytest.mark.parametrize(
    ("spec", "message"),
    [("nice", "expected NAME=JSON"), ('x={"poll_min_s": 0.001}', "unknown keys ['poll_min_s']"),
     ("x=[1]", "unknown keys")],
)  # fmt: skip
def test_a_bad_variant_says_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        pd_ab.parse_variant(spec)


def test_steal_is_the_eighth_counter_over_all_time_spent() -> None:
    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [200, 0, 100, 1600, 0, 0, 0, 100, 0, 0]
    assert pd_ab.steal_fraction(before, after) == pytest.approx(50 / 1000)
    assert pd_ab.steal_fraction(before, before) == 0.0


def row(rnd: int, variant: str, ttft: float, rate: float) -> dict:
    return {
        "round": rnd, "variant": variant, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft, "tpot_p50_ms": 5.0,
        "req_per_s": rate, "failed": 0, "shed": 0, "steal": 0.0, "d_rounds_per_request": 1.0,
        "p_cpu_ms_per_request": 30.0, "d_cpu_ms_per_request": 20.0,
        "d_endpoint_cpu_ms_per_request": 0.5, "p_rounds_per_request": 3.0,
        "p_endpoint_cpu_ms_per_request": 0.4,
    }  # fmt: skip


def test_ratios_are_to_the_same_rounds_pull() -> None:
    rows = [row(0, "pull", 100, 10), row(0, "kvferry", 50, 11)]
    rows += [row(1, "pull", 200, 10), row(1, "kvferry", 300, 9)]
    text = pd_ab.report(rows, "cmd")
    assert "| 0 | kvferry | 50.0 | 0.50 |" in text and "| 1 | kvferry | 300.0 | 1.50 |" in text
    assert "- kvferry: TTFT p50 ms 1.00 (0.50-1.50)" in text  # median of 0.5 and 1.5
    assert "- pull: TTFT p50 ms 2.00" in text  # the same variant moved 2x between rounds
