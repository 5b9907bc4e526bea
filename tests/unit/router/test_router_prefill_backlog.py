"""Past saturation the router refuses (429) what a prefill engine could not start within
limits.max_prefill_wait_s, from its own legs: tokens queued there / the rate it finishes them while busy."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import given
from hypothesis import strategies as st
from kvferry.router.backlog import PrefillBacklog

from tests.unit.router.engines import FakeEngine, router_state, run
from tests.waiting import wait_until_async

URL = "http://p0"


def test_rate_is_tokens_per_busy_second_and_idle_gaps_do_not_dilute_it() -> None:
    b = PrefillBacklog(window_s=1.0)
    assert b.wait_s(URL, 100) is None  # nothing measured: never refuse on a guess
    b.started(URL, 300, now=0.0)
    b.finished(URL, 300, now=0.6)
    b.started(URL, 1, now=1.0)
    assert b.wait_s(URL, 100) is None  # 0.6 s busy: the window is not full yet
    b.finished(URL, 1, now=1.0)
    b.started(URL, 199, now=10.0)  # 9.4 s idle in between
    b.finished(URL, 199, now=10.4)
    b.started(URL, 400, now=11.0)
    assert b.wait_s(URL, 100) == pytest.approx(500 / 500)  # 500 tokens/busy s; 400 ahead + its 100


def test_an_engine_with_none_of_our_legs_open_is_never_refused() -> None:
    b = PrefillBacklog(window_s=1.0)
    b.started(URL, 100, now=0.0)
    b.finished(URL, 100, now=1.0)
    for t in range(2, 12):  # P frozen: every leg times out, the rate falls towards 0
        b.started(URL, 100, now=float(t))
        b.finished(URL, 100, now=t + 1.0, completed=False)
    assert b.wait_s(URL, 100) is None, "idle: it starts at once, and only admitted legs can re-measure it"
    b.started(URL, 100, now=20.0)
    assert b.wait_s(URL, 100) > 60  # busy and measured slow: this one would wait


def test_overlapping_legs_count_their_busy_time_once() -> None:
    b = PrefillBacklog(window_s=1.0)
    b.started(URL, 100, now=0.0)
    b.started(URL, 100, now=0.2)
    b.finished(URL, 100, now=0.5)
    b.finished(URL, 100, now=1.0)  # busy 0.0-1.0: 200 tokens in 1 s (not in 1.3 s of leg time)
    b.started(URL, 200, now=2.0)
    assert b.wait_s(URL, 0) == pytest.approx(1.0)


def test_a_failed_leg_frees_its_tokens_and_its_time_counts_without_work() -> None:
    b = PrefillBacklog(window_s=1.0)
    b.started(URL, 100, now=0.0)
    b.finished(URL, 100, now=1.0)  # 100 tokens/s
    b.started(URL, 5000, now=2.0)
    assert b.wait_s(URL, 0) == pytest.approx(50.0)
    b.finished(URL, 5000, now=3.0, completed=False)  # timed out: 1 s of the engine, nothing prefilled
    b.started(URL, 0, now=3.5)
    assert b.wait_s(URL, 100) == pytest.approx(100 / 50)  # its queue is gone; it looks slower now
    b.finished(URL, 0, now=3.5)
    b.started(URL, 50, now=4.0)
    b.finished(URL, 50, now=4.5)
    b.started(URL, 50, now=5.0)
    b.finished(URL, 50, now=5.5)  # 100 tokens in 1 busy second: the average recovers
    b.started(URL, 0, now=6.0)
    assert b.wait_s(URL, 100) == pytest.approx(100 / (0.5 * 100 + 0.5 * 50))


def test_engines_that_left_are_forgotten_once_idle() -> None:
    b = PrefillBacklog()
    b.started("http://a", 10, now=0.0)
    b.started("http://b", 10, now=0.0)
    b.finished("http://b", 10, now=0.1)
    b.forget({"http://c"})
    assert set(b.engines) == {"http://a"}  # a leg is still open there


@given(st.lists(st.tuples(st.integers(1, 4096), st.floats(0.01, 2.0), st.floats(0, 5.0)), min_size=1))
def test_sequential_legs_give_their_exact_rate(legs: list[tuple[int, float, float]]) -> None:
    busy = sum(d for _, d, _ in legs)  # one window closed by the last leg: total tokens / busy time
    b, now = PrefillBacklog(window_s=busy * (1 - 1e-9)), 0.0  # (the clock sums with rounding)
    for tokens, duration, gap in legs:
        b.started(URL, tokens, now)
        b.finished(URL, tokens, now + duration)
        now += duration + gap
    b.started(URL, 0, now)
    rate = sum(t for t, _, _ in legs) / busy
    assert b.wait_s(URL, 1000) == pytest.approx(1000 / rate, rel=1e-6)


def prompt(i: int) -> dict:
    """100 token ids (counted exactly), a different prompt each time: no prefix hit lowers the count."""
    return {"model": "tiny", "prompt": list(range(1000 * i, 1000 * i + 100)), "max_tokens": 2}


def test_a_request_prefill_could_not_start_in_time_gets_429_before_anything_is_spent() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        for i in range(4):  # 4 x 0.3 s busy: ~333 tokens/s measured
            assert (await client.post("/v1/completions", json=prompt(i))).status == 200
        seen = len(p.seen), len(d.seen)
        first = asyncio.create_task(client.post("/v1/completions", json=prompt(4)))
        backlog = router_state(client).backlog
        await wait_until_async(lambda: backlog.engines[p.url].legs == 1, "the first prefill leg open", 10)
        resp = await client.post("/v1/completions", json=prompt(5))  # (100 ahead + 100) / 333 = 0.6 s
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
        # Legs take at least their 0.3 s: the rate is at most 333 tokens/s, the estimate at least 0.6 s
        # (a busy host only makes it larger; the exact figure is the host's).
        found = re.search(r"prefill prefill-0 would start this request in ~(\d+\.\d)s", error["message"])
        assert error["code"] == "overloaded" and found and float(found[1]) >= 0.6, error["message"]
        assert "limits.max_prefill_wait_s" in error["message"]
        assert (await first).status == 200
        assert (len(p.seen), len(d.seen)) == (seen[0] + 1, seen[1] + 1), "the refused one reached no engine"
        assert (await client.post("/v1/completions", json=prompt(6))).status == 200, "drained: admitted"
        metrics = await (await client.get("/metrics")).text()
        assert 'outcome="overloaded"} 1.0' in metrics
        assert 'kvferry_router_shed_total{limit="max_prefill_wait_s",role="prefill"} 1.0' in metrics

    run("kvferry", "slow:0.3", "after_prefill", check, limits={"max_prefill_wait_s": 0.5})


def test_unset_the_limit_is_the_prefill_deadline() -> None:
    body = prompt(0)

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        planner = router_state(client).planner
        assert planner.max_prefill_wait_s == 3.0
        assert (await client.post("/v1/completions", json=body)).status == 200

    run("vllm-pull", "ok", "ok", check, deadlines={"prefill_s": 3.0})
