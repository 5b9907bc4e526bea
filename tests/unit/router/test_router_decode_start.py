"""push.decode_start before-prefill (mode kvferry): the router opens decode's leg when prefill is about
to start the request by its backlog estimate, or when prefill's leg ends, whichever is first; never
later, and a request whose decode leg was never sent frees prefill at once when its client leaves."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from kvferry.router.config import ConfigError, parse_config

from tests.unit.router.engines import FakeEngine, config, router_state, run
from tests.waiting import wait_until_async

LATER: dict = {
    "push": {"decode_start": "before-prefill", "decode_lead_s": 0.05},
    "limits": {"max_prefill_wait_s": 30},  # admit what the tests queue
}


def prompt(i: int, tokens: int) -> dict:
    """`tokens` token ids (counted exactly by the backlog), different for every i."""
    return {"model": "tiny", "prompt": list(range(10_000 * i, 10_000 * i + tokens)), "max_tokens": 2}


async def one_ahead(client: TestClient, p: FakeEngine, tokens_per_s: float, tokens: int) -> asyncio.Task:
    """Give the router's backlog a measured prefill rate (without waiting for one), then open a first
    request of `tokens` on P; returns its task once its prefill leg is open."""
    backlog = router_state(client).backlog
    backlog.started(p.url, int(tokens_per_s), 0.0)
    backlog.finished(p.url, int(tokens_per_s), 1.0)
    first = asyncio.create_task(client.post("/v1/completions", json=prompt(1, tokens)))
    await wait_until_async(lambda: backlog.engines[p.url].legs == 1, "the first prefill leg open", 10)
    return first


def seen_at(engine: FakeEngine, i: int) -> float:
    return next(s["t"] for s in engine.seen if s["body"]["prompt"][0] == 10_000 * i)


def test_decode_opens_when_prefill_ends_even_if_the_estimate_says_later() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        first = await one_ahead(client, p, 1000, 5000)
        # 5,000 tokens ahead at 1,000/s: the estimate says 5 s; P's leg actually ends after 0.3 s.
        resp = await client.post("/v1/completions", json=prompt(2, 100))
        assert resp.status == 200 and (await first).status == 200
        assert seen_at(d, 1) - seen_at(p, 1) < 0.25, "nothing ahead of the first: D opened at once"
        waited = seen_at(d, 2) - seen_at(p, 2)
        assert 0.25 <= waited < 4.5, f"D opened {waited:.2f}s after P: held back, and opened at P's end"
        metrics = await (await client.get("/metrics")).text()
        assert "kvferry_router_decode_delay_seconds_count 1.0" in metrics

    run("kvferry", "slow:0.3", "after_prefill", check, **LATER)


def test_decode_opens_before_prefill_ends_when_the_estimate_is_due() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        first = await one_ahead(client, p, 1000, 300)
        second = asyncio.create_task(client.post("/v1/completions", json=prompt(2, 100)))
        # 300 tokens ahead: due after 0.3 - 0.05 s, while P's 1.5 s leg still runs.
        await wait_until_async(lambda: len(d.seen), "D's second leg", 10, until=lambda n: n == 2)
        assert len(p.finished) == 0, "D's leg was sent before P finished either request"
        assert seen_at(d, 2) - seen_at(p, 2) >= 0.2
        assert (await first).status == 200 and (await second).status == 200

    run("kvferry", "slow:1.5", "after_prefill", check, **LATER)


def test_a_client_gone_before_decode_was_sent_frees_prefill_at_once() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        first = await one_ahead(client, p, 100, 1000)
        dispatcher, backlog = router_state(client).serving.dispatcher, router_state(client).backlog
        url = str(client.make_url("/v1/completions"))
        async with aiohttp.ClientSession() as session:
            with contextlib.suppress(asyncio.TimeoutError):  # gives up 10 s before D would open
                await session.post(url, json=prompt(2, 100), timeout=aiohttp.ClientTimeout(0.3))
        await wait_until_async(
            lambda: backlog.engines[p.url].legs, "its prefill leg closed", 2, until=lambda n: n == 1
        )
        assert not dispatcher.detached, "no prefill leg left running for a request nobody will decode"
        assert [s["body"]["prompt"][0] for s in d.seen] == [10_000], "D never got the abandoned request"
        assert (await first).status == 200

    run("kvferry", "slow:3", "after_prefill", check, **LATER)


@pytest.mark.parametrize("mode", ["vllm-push", "vllm-pull"])
def test_before_prefill_is_refused_outside_mode_kvferry(mode: str) -> None:
    p = SimpleNamespace(name="prefill-0", url="http://127.0.0.1:9")  # never started: config only
    d = SimpleNamespace(name="decode-0", url="http://127.0.0.1:10")
    raw = config(mode, p, d, **LATER)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"push.decode_start: 'before-prefill' needs mode kvferry"):
        parse_config(raw)
    assert parse_config(config(mode, p, d)).push.decode_start == "with-prefill"  # type: ignore[arg-type]


def test_kvferry_defers_decode_by_default_and_with_prefill_can_be_chosen() -> None:
    p = SimpleNamespace(name="prefill-0", url="http://127.0.0.1:9")
    d = SimpleNamespace(name="decode-0", url="http://127.0.0.1:10")
    assert parse_config(config("kvferry", p, d)).push.decode_start == "before-prefill"  # type: ignore[arg-type]
    chosen = config("kvferry", p, d, push={"decode_start": "with-prefill"})  # type: ignore[arg-type]
    assert parse_config(chosen).push.decode_start == "with-prefill"
