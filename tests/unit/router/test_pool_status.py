"""Transfer status in O(services) (issue 19): the router gathers its engines' transfer metrics into one
answer (the operator's side: tests/unit/operator/test_pool_status_read_by_the_operator.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient
from kvferry.contracts.pods import POOL_METRICS_PATH
from kvferry.router import poolstatus
from kvferry.router.config import Endpoint
from kvferry.router.poolstatus import gather, transfer_families

from tests.unit.router.engines import FakeEngine, run

PREFILL = """# HELP kvferry_transfers_total Transfers
# TYPE kvferry_transfers_total counter
kvferry_transfers_total{backend="UCX"} 12.0
# HELP vllm:num_requests_waiting waiting
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:nixl_num_failed_transfers_total 1.0
"""


def test_only_the_families_transfer_status_reads_are_kept() -> None:
    kept = transfer_families(PREFILL)
    assert 'kvferry_transfers_total{backend="UCX"} 12.0' in kept
    assert "vllm:nixl_num_failed_transfers_total 1.0" in kept
    assert "num_requests_waiting" not in kept
    assert transfer_families("") == ""


def test_the_router_gathers_every_engine_and_counts_the_silent_ones() -> None:
    async def run() -> dict[str, Any]:
        app = web.Application()

        async def prefill(_: web.Request) -> web.Response:
            return web.Response(text=PREFILL)

        async def decode(_: web.Request) -> web.Response:
            return web.Response(text="kvferry_transfers_total 0\n")

        app.router.add_get("/p/metrics", prefill)
        app.router.add_get("/d/metrics", decode)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        base = f"http://127.0.0.1:{port}"
        ep = lambda role, path: Endpoint(role, base + path, f"{role}{path}", "127.0.0.1", 1)  # noqa: E731
        try:
            async with aiohttp.ClientSession() as session:
                return await gather(
                    session, (ep("prefill", "/p"),), (ep("decode", "/d"), ep("decode", "/gone"))
                )
        finally:
            await runner.cleanup()

    got = asyncio.run(run())
    assert got["prefill"] == [transfer_families(PREFILL)]
    assert got["decode"] == ["kvferry_transfers_total 0\n"]
    assert got["unreachable"] == {"prefill": 0, "decode": 1}


def test_the_route_is_served_without_the_api_key_like_metrics() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.get(POOL_METRICS_PATH)  # no Authorization header: the operator holds no key
        assert resp.status == 200
        body = await resp.json()
        # The stand-in engines serve no /metrics: both are counted, neither is invented.
        assert body == {"prefill": [], "decode": [], "unreachable": {"prefill": 1, "decode": 1}}
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 401

    run("kvferry", "ok", "ok", check, api_key="secret")


def test_concurrent_callers_share_one_scrape_and_its_answer_is_reused_for_a_moment() -> None:
    """The route is unauthenticated: 20 callers at once cost each engine one read, not 20."""

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        p.metrics_text = d.metrics_text = "kvferry_transfers_total 0\n"
        answers = await asyncio.gather(*(client.get(POOL_METRICS_PATH) for _ in range(20)))
        assert [a.status for a in answers] == [200] * 20
        assert p.metrics_reads == 1  # prefill: only this route reads it (the load scrape reads decode)
        assert (await client.get(POOL_METRICS_PATH)).status == 200
        assert p.metrics_reads == 1  # within CACHE_TTL_S: the same answer

    run("kvferry", "ok", "ok", check)


def test_the_cache_expires_and_follows_the_pool() -> None:
    now = [0.0]
    cache = poolstatus.PoolMetrics(ttl_s=2.0, clock=lambda: now[0])
    a = (Endpoint("prefill", "http://127.0.0.1:9", "p", "127.0.0.1", 1),)
    b = (Endpoint("decode", "http://127.0.0.1:9", "d", "127.0.0.1", 1),)

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            await cache.get(session, (a, b))
            await cache.get(session, (a, b))
            assert cache.scrapes == 1
            now[0] = 2.5
            await cache.get(session, (a, b))
            assert cache.scrapes == 2
            await cache.get(session, (a, ()))  # another pool: never the old pool's answer
            assert cache.scrapes == 3

    asyncio.run(scenario())


def _serve(body: bytes, pieces: int) -> web.Application:
    async def metrics(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        step = len(body) // pieces + 1
        for i in range(0, len(body), step):
            await resp.write(body[i : i + step])
            await asyncio.sleep(0.01)  # separate reads on the router's side
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def test_an_engines_metrics_are_read_whole_and_no_further_than_the_cap() -> None:
    lines = "".join(f'kvferry_transfers_total{{n="{i}"}} {i}\n' for i in range(20_000))  # ~600 KB

    async def fetch(body: bytes) -> dict[str, Any]:
        runner = web.AppRunner(_serve(body, pieces=8))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                return await gather(session, (Endpoint("prefill", url, "p", "127.0.0.1", 1),), ())
        finally:
            await runner.cleanup()

    got = asyncio.run(fetch(lines.encode()))
    assert got["prefill"] == [lines]  # every piece, not the first read's (the old read(n) stopped there)
    too_big = b"x" * (poolstatus.MAX_ENGINE_BYTES + 1)
    assert asyncio.run(fetch(too_big))["unreachable"] == {"prefill": 1, "decode": 0}
