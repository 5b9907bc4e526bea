"""A client that disconnects cancels its request wherever it is, for every kind of request: the router
closes the legs it opened (vLLM aborts a request whose connection closed) and frees their in-flight
slots. Run through the real `kvferry router` process (its serving options are the thing under test;
aiohttp's test server would cancel handlers on its own), with stand-in engines that never finish and
record when the router closed their connection. Before, an aggregated (non-streaming) request kept
decoding for nobody until the total deadline (here 600 s)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.pdstack import RouterProcess

from tests.unit.router.engines import FakeEngine, config

KINDS = {
    "aggregated": {"prompt": "hi", "max_tokens": 100_000},  # the router streams D, answers in one JSON
    "streamed": {"prompt": "hi", "max_tokens": 100_000, "stream": True},
    "plain": {"prompt": "hi", "max_tokens": 100_000, "logprobs": 1},  # D answers non-streaming
}


async def _until(check: Callable[[], bool], what: str) -> None:
    for _ in range(600):  # at most ~30 s, far below the 600 s the router would otherwise hold on
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {what}")


async def _leave_after_engine_sees(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                                   engine: FakeEngine) -> str:  # fmt: skip
    """Send the request, and close its connection once `engine` got its leg; returns the request id."""
    before = len(engine.seen)

    async def ask() -> None:
        async with session.post(url + "/v1/completions", json=body) as resp:
            await resp.read()

    task = asyncio.create_task(ask())
    await _until(lambda: len(engine.seen) > before, "the leg reach the engine")
    await asyncio.sleep(0.1)  # the leg is under way (a stream has sent tokens)
    task.cancel()  # closes the client's connection
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return str(engine.seen[-1]["rid"])


@pytest.mark.parametrize("mode,leg", [("kvferry", "decode"), ("vllm-pull", "prefill")])
def test_a_client_that_leaves_cancels_every_kind_of_request(tmp_path: Path, mode: str, leg: str) -> None:
    async def scenario() -> None:
        p = FakeEngine("prefill-0", "endless" if leg == "prefill" else "ok")
        d = FakeEngine("decode-0", "endless" if leg == "decode" else "ok")
        await p.server.start_server()
        await d.server.start_server()
        engine = p if leg == "prefill" else d
        deadlines = {"prefill_s": 600, "decode_first_token_s": 600, "transfer_s": 1, "total_s": 600}
        router = RouterProcess(config(mode, p, d, deadlines=deadlines), tmp_path)
        await asyncio.to_thread(router.start)
        try:
            async with aiohttp.ClientSession() as session:
                kinds = KINDS if leg == "decode" else {"aggregated": KINDS["aggregated"]}
                for kind, body in kinds.items():
                    rid = await _leave_after_engine_sees(session, router.url, body, engine)
                    closed = lambda rid=rid: rid in engine.closed  # noqa: E731
                    await _until(closed, f"the {kind} request's {leg} leg closed")

                async def in_flight() -> float:
                    async with session.get(router.url + "/metrics") as resp:
                        return metric_sum(parse_metrics(await resp.text()), "kvferry_router_in_flight")

                for _ in range(200):
                    if await in_flight() == 0:
                        break
                    await asyncio.sleep(0.05)
                assert await in_flight() == 0, "in-flight slots held after the clients left"
                async with session.get(router.url + "/metrics") as resp:
                    text = await resp.text()
                gone = metric_sum(
                    parse_metrics(text), "kvferry_router_requests_total", outcome="client_disconnect"
                )
                assert gone == len(kinds), text
        finally:
            await asyncio.to_thread(router.stop)
            await p.server.close()
            await d.server.close()

    asyncio.run(scenario())
