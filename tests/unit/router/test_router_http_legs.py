"""Router HTTP behaviour against small real aiohttp servers standing in for vLLM engines (engines.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from aiohttp.test_utils import TestClient
from kvferry.contracts.promtext import metric_sum, parse_metrics

from tests.unit.router.engines import FakeEngine, run
from tests.waiting import wait_until_async

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 5}


def test_push_sends_both_legs_with_one_request_id() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "from decode-0"
        assert "stream_options" not in p.seen[0]["body"]
        rid = resp.headers["X-Request-Id"]
        assert p.seen[0]["rid"] == d.seen[0]["rid"] == rid
        assert (
            p.seen[0]["body"]["max_tokens"] == 1
            and p.seen[0]["body"]["kv_transfer_params"]["do_remote_decode"]
        )
        assert d.seen[0]["body"]["kv_transfer_params"]["remote_request_id"] == f"cmpl-{rid}-0"
        assert d.seen[0]["body"]["max_tokens"] == 5
        # D streams even for a non-streaming client, so the router sees (and bounds) its first token.
        assert d.seen[0]["body"]["stream"] is True
        answer = await resp.json()
        assert answer["choices"][0]["token_ids"] == [0, 1, 2] and answer["usage"] == {"completion_tokens": 3}

    run("vllm-push", "ok", "ok", check)


def test_push_legs_are_concurrent_and_pull_legs_sequential() -> None:
    async def concurrent(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        assert (await client.post("/v1/completions", json=BODY)).status == 200
        assert d.seen[0]["t"] < p.seen[0]["t"] + 0.4, "push must not wait for prefill before decode"

    async def sequential(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        assert (await client.post("/v1/completions", json=BODY)).status == 200
        assert d.seen[0]["t"] >= p.seen[0]["t"] + 0.45, "pull sends decode after prefill answered"
        assert d.seen[0]["body"]["kv_transfer_params"] == {
            "do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [[1]]
        }  # fmt: skip

    run("vllm-push", "slow", "ok", concurrent)
    run("vllm-pull", "slow", "ok", sequential)


def test_prefill_failure_recomputes_on_decode() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 200
        assert resp.headers["X-Kvferry-Recomputed"] == "prefill_unreachable"
        assert "kv_transfer_params" not in d.seen[-1]["body"], "recompute is a plain local request"
        metrics = await (await client.get("/metrics")).text()
        assert 'kvferry_router_recomputes_total{reason="prefill_unreachable"} 1.0' in metrics
        # The request's own outcome says so too (the e2e baselines' books rely on both counts).
        assert metric_sum(parse_metrics(metrics), "kvferry_router_requests_total", outcome="recomputed") == 1

    async def kill_prefill_then_check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        await p.server.close()
        await check(client, p, d)

    run("vllm-push", "ok", "stall", lambda c, p, d: _expect_stuck_decode(c, p, d))
    run("vllm-pull", "ok", "ok", kill_prefill_then_check)


async def _expect_stuck_decode(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
    """A streaming decode that never answers is abandoned at decode_first_token_s and recomputed on P."""
    start = time.monotonic()
    resp = await client.post("/v1/completions", json={**BODY, "stream": True})
    text = await resp.text()
    assert resp.status == 200 and resp.headers["X-Kvferry-Recomputed"] == "decode_timeout"
    assert '"from"' in text and "prefill-0" in text and "[DONE]" in text
    assert time.monotonic() - start < 3


def test_everything_stuck_ends_in_504_within_total_deadline() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        start = time.monotonic()
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 504
        body = await resp.json()
        assert body["error"]["type"] == "timeout" and "decode-0" in body["error"]["message"]
        assert time.monotonic() - start < 4 + 1

    run("vllm-push", "stall", "stall", check)


def test_engine_rejection_is_passed_through_not_recomputed() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 400
        assert (await resp.json())["error"]["message"] == "prefill-0 says no"
        metrics = await (await client.get("/metrics")).text()
        assert "kvferry_router_recomputes_total{" not in metrics

    run("vllm-pull", "error400", "ok", check)


def test_client_disconnect_never_cancels_prefill() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        url = str(client.make_url("/v1/completions"))
        async with aiohttp.ClientSession() as session:
            # The client gives up while prefill is still running.
            with contextlib.suppress(asyncio.TimeoutError):
                await session.post(url, json={**BODY, "stream": True}, timeout=aiohttp.ClientTimeout(0.2))
        # The prefill leg runs to completion after the client left.
        await wait_until_async(
            lambda: len(p.finished), "the prefill leg to finish", 10, until=lambda n: n == 1
        )

    run("vllm-push", "slow", "ok", check)


def test_errors_are_openai_shaped() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", data=b"{not json")
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_json"
        resp = await client.post("/v1/completions", json={**BODY, "model": "gpt-9"})
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
        resp = await client.get("/v1/nothing")
        assert resp.status == 404 and "error" in await resp.json()
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]

    run("kvferry", "ok", "ok", check)


def test_api_key_is_required_on_v1_but_not_on_health_or_livez() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        assert (await client.get("/health")).status == 200
        assert (await client.get("/livez")).status == 200  # the liveness probe carries no key either
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
        bad = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
        assert bad.status == 401
        good = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer s3cret"})
        assert good.status == 200

    run("kvferry", "ok", "ok", check, api_key="s3cret")


def test_push_decode_that_never_starts_after_prefill_is_recomputed() -> None:
    """Upstream push can lose a registration and leave D waiting for KV forever, silently."""

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        start = time.monotonic()
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status == 200 and resp.headers["X-Kvferry-Recomputed"].startswith("decode_")
        assert (await resp.json())["choices"][0]["text"] == "from prefill-0"
        assert time.monotonic() - start < 3.5

    run("vllm-push", "ok", "stall", check)
