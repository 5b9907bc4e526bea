"""bench/soak.py's pure parts: the seeded plan, error classification and the avoidable-error rule."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_bench = Path(__file__).parents[3] / "bench"
sys.path.append(str(_bench))  # soak.py imports its sibling soak_report, as when run as a script
_spec = importlib.util.spec_from_file_location("bench_soak", _bench / "soak.py")
assert _spec is not None and _spec.loader is not None
soak = sys.modules["bench_soak"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(soak)


def outcome(stream: bool, start: float, end: float, first_token: float | None = None) -> object:
    req = soak.Req(0, "/v1/completions", stream, 5, 8)
    return soak.Outcome(req, result="error", start=start, end=end, first_token=first_token)


def test_plan_is_seeded_and_faults_fire_inside_the_window() -> None:
    cfg = soak.Config(requests=200, faults=5, cancels=7, seed=3)
    a, b = soak.make_plan(cfg), soak.make_plan(cfg)
    assert a == b
    reqs, faults = a
    assert sum(bool(r.cancel) for r in reqs) == 7 and all(r.stream for r in reqs if r.cancel)
    assert [f.at for f in faults] == sorted(f.at for f in faults)
    assert all(10 <= f.at < 170 for f in faults) and {f.kind for f in faults} == set(soak.FAULT_KINDS)
    ordered = soak.make_plan(soak.Config(requests=50, plan=("stop-prefill", "kill-prefill")))[1]
    assert [f.kind for f in ordered] == ["stop-prefill", "kill-prefill"] and 2 <= ordered[0].stop_s <= 10


def test_an_error_is_avoidable_only_before_the_first_token_with_one_engine_up_throughout() -> None:
    down = {"prefill": [[10.0, 20.0]], "decode": []}
    assert soak.is_avoidable(outcome(False, 12, 13), down)  # P down, D up the whole time
    assert soak.is_avoidable(outcome(True, 30, 31), down)  # both up (e.g. a stale peer after restart)
    assert not soak.is_avoidable(outcome(True, 12, 13, first_token=12.5), down)  # a token was out
    assert soak.is_avoidable(outcome(False, 12, 13, first_token=12.5), down)  # non-streamed: none sent
    both = {"prefill": [[10.0, 20.0]], "decode": [[19.0, None]]}  # D killed, not back yet
    assert not soak.is_avoidable(outcome(False, 12, 21), both)
    assert soak.is_avoidable(outcome(False, 12, 18), both)


def test_errors_are_clear_only_with_an_openai_error_body() -> None:
    o = outcome(False, 0, 1)
    o.status = 502
    soak.error_of(o, b'{"error": {"message": "decode failed", "code": "decode_unreachable"}}')
    assert (o.result, o.code) == ("error", "decode_unreachable")
    soak.error_of(o, b"<html>Bad Gateway</html>")
    assert o.result == "lost" and "without an OpenAI error body" in o.detail
