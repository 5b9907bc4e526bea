"""Overload control: a per-engine in-flight limit (429 + Retry-After when a role is full) and a
recompute budget (a clear 503 once recomputes would exceed a fraction of recent requests)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient
from kvferry.router.budget import RecomputeBudget
from kvferry.router.discovery import Pool
from kvferry.router.selection import LoadTracker, OverloadedError, Selector

from tests.unit.router.engines import FakeEngine, router_state, run
from tests.unit.router.test_router_selection import ep
from tests.waiting import wait_until_async

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 5}


def test_selection_skips_engines_at_their_limit() -> None:
    tracker = LoadTracker()
    sel = Selector("least-loaded", tracker, max_in_flight=2)
    pool = Pool(prefill=(ep("prefill", 5),), decode=(ep("decode", 0), ep("decode", 1)))  # own URLs
    tracker.observe(pool.decode[1], waiting=50, kv_usage=0.9)  # busier by its queue, but has room
    for _ in range(2):
        tracker.begin(pool.decode[0])
    assert sel.choose(pool)[1].engine_id == "decode-1"
    for _ in range(2):
        tracker.begin(pool.decode[1])
    with pytest.raises(OverloadedError, match="every decode engine is at its limit of 2") as err:
        sel.choose(pool)
    assert err.value.role == "decode"
    tracker.end(pool.decode[0])
    tracker.begin(pool.prefill[0])
    tracker.begin(pool.prefill[0])
    with pytest.raises(OverloadedError, match="every prefill engine"):
        sel.choose(pool)


def test_full_decode_gets_429_with_retry_after() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        first = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await wait_until_async(lambda: p.seen and d.seen, "both legs of the first request in flight", 10)
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
        assert error["code"] == "overloaded" and error["type"] == "rate_limit_error"
        assert "decode" in error["message"] and "limit of 1" in error["message"]
        assert (await first).status == 200
        assert (await client.post("/v1/completions", json=BODY)).status == 200, "room again"
        metrics = await (await client.get("/metrics")).text()
        assert 'outcome="overloaded"} 1.0' in metrics
        assert 'kvferry_router_errors_total{status="429"} 1.0' in metrics
        assert 'kvferry_router_shed_total{limit="max_in_flight_per_engine",role="decode"} 1.0' in metrics

    run("kvferry", "slow:0.6", "after_prefill", check, limits={"max_in_flight_per_engine": 1})


def test_recompute_budget_refuses_with_503_naming_the_failure() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        first = await client.post("/v1/completions", json=BODY)
        assert first.status == 200 and first.headers["X-Kvferry-Recomputed"] == "prefill_status_500"
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
        assert error["code"] == "recompute_budget_exhausted"
        assert "prefill prefill-0 answered 500" in error["message"]
        assert "recompute budget is exhausted" in error["message"]
        assert len(d.seen) == 1, "no second recompute was sent"
        metrics = await (await client.get("/metrics")).text()
        assert 'outcome="recompute_budget_exhausted"} 1.0' in metrics
        assert 'kvferry_router_leg_errors_total{leg="prefill",reason="status_500"} 2.0' in metrics

    limits = {"recompute_ratio": 0, "recompute_burst": 1}
    run("vllm-pull", "error500", "ok", check, limits=limits)


def test_budget_is_a_fraction_of_recent_requests_plus_a_burst() -> None:
    budget = RecomputeBudget(ratio=0.5, burst=2)
    assert budget.withdraw() and budget.withdraw() and not budget.withdraw()
    budget.deposit()
    assert not budget.withdraw(), "half a request's worth is not a recompute"
    budget.deposit()
    assert budget.withdraw() and not budget.withdraw()
    for _ in range(100):  # a long quiet spell banks no more than the burst
        budget.deposit()
    assert budget.withdraw() and budget.withdraw() and not budget.withdraw()
    no_burst = RecomputeBudget(ratio=0.25, burst=0)
    assert not no_burst.withdraw()
    for _ in range(4):
        no_burst.deposit()
    assert no_burst.withdraw(), "the ratio alone still allows one recompute per 1/ratio requests"


def test_a_failed_transfer_is_recomputed_even_with_the_budget_spent() -> None:
    """The budget caps recomputes that add load (timeouts, 5xx). A receive that failed (or an engine
    that is down) costs the pool nothing extra: with one P/D pair and an engine down for a minute,
    refusing those would turn every request of that minute into an avoidable error."""

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        for _ in range(3):
            resp = await client.post("/v1/completions", json={**BODY, "stream": True})
            assert resp.status == 200 and resp.headers["X-Kvferry-Recomputed"] == "decode_error_event"
            await resp.read()

    run("kvferry", "ok", "error_event", check, limits={"recompute_ratio": 0, "recompute_burst": 0})


def test_an_engine_that_is_down_is_recomputed_elsewhere_even_with_the_budget_spent() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        await d.server.close()  # D is gone: connection refused
        for _ in range(3):
            resp = await client.post("/v1/completions", json=BODY)
            assert resp.status == 200 and resp.headers["X-Kvferry-Recomputed"] == "decode_unreachable"

    run("kvferry", "ok", "ok", check, limits={"recompute_ratio": 0, "recompute_burst": 0})


def test_prefill_leg_is_closed_when_decode_failed_first() -> None:
    """D failed before P finished: nobody will take P's KV, so P's leg is closed (vLLM aborts the
    prefill and frees its blocks) instead of being left to finish and hold them for its lease."""

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert resp.status == 200 and resp.headers["X-Kvferry-Recomputed"] == "decode_error_event"
        await resp.read()
        await asyncio.sleep(0.5)  # past P's 2 s: a leg left running would have finished by now
        pd_leg = p.seen[0]["rid"]
        assert pd_leg not in p.finished, "P's leg was left running for nobody"
        assert not router_state(client).serving.dispatcher.detached

    # The recompute lands on the same slow P (2 s): give its first token room.
    run("kvferry", "slow:2", "error_event", check, deadlines={"decode_first_token_s": 4, "total_s": 8})
