"""Transfer status in O(services) (issue 19): the router gathers its engines' transfer metrics into one
answer (the operator's side: tests/unit/operator/test_pool_status_read_by_the_operator.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient
from kvferry.contracts.pods import POOL_METRICS_PATH
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
