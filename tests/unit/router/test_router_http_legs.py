"""Router HTTP behaviour against small real aiohttp servers standing in for vLLM engines.

The stand-ins only record what they receive and answer as told (ok, error, stall); they prove the
router's own logic (leg bodies, shared request id, recompute, deadlines, errors), not P/D itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from kvferry.connector.router.app import build_app
from kvferry.connector.router.config import parse_config


class FakeEngine:
    """Records requests; `mode` is 'ok', 'error500', 'error400' or 'stall'."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name, self.mode = name, mode
        self.seen: list[dict[str, Any]] = []
        self.finished: list[str] = []
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        self.server = TestServer(app, host="127.0.0.1")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"rid": request.headers.get("X-Request-Id"), "body": body, "t": time.monotonic()})
        if self.mode == "stall":
            await asyncio.sleep(3600)
        if self.mode == "slow":
            await asyncio.sleep(0.5)
        if self.mode.startswith("error"):
            status = int(self.mode[5:])
            return web.json_response({"error": {"message": f"{self.name} says no"}}, status=status)
        self.finished.append(request.headers.get("X-Request-Id", ""))
        kv = {"do_remote_prefill": True, "remote_engine_id": self.name, "remote_block_ids": [[1]]}
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, word in enumerate(("from", " ", self.name)):
                choice = {"index": 0, "text": word, "token_ids": [i]}
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                await asyncio.sleep(0.05)
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"choices": [], "usage": {"completion_tokens": 3}}
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"choices": [{"text": f"from {self.name}"}], "kv_transfer_params": kv})

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


def _config(mode: str, p: FakeEngine, d: FakeEngine, **extra: Any) -> dict[str, Any]:
    def entry(e: FakeEngine, port: int) -> dict[str, Any]:
        return {"url": e.url, "engine_id": e.name, "side_host": "127.0.0.1", "side_port": port}

    return {
        "mode": mode, "model": "tiny",
        "deadlines": {"prefill_s": 2, "decode_first_token_s": 1, "transfer_s": 5, "total_s": 4},
        "discovery": {"static": {"prefill": [entry(p, 5600)], "decode": [entry(d, 5601)]}}, **extra,
    }  # fmt: skip


Check = Callable[[TestClient, FakeEngine, FakeEngine], Awaitable[None]]


def run(mode: str, p_mode: str, d_mode: str, test: Check, api_key: str | None = None) -> None:
    async def main() -> None:
        p, d = FakeEngine("prefill-0", p_mode), FakeEngine("decode-0", d_mode)
        await p.server.start_server()
        await d.server.start_server()
        client = TestClient(
            TestServer(build_app(parse_config(_config(mode, p, d)), api_key), host="127.0.0.1")
        )
        await client.start_server()
        try:
            await asyncio.wait_for(test(client, p, d), 30)
        finally:
            await client.close()
            await p.server.close()
            await d.server.close()

    asyncio.run(main())


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
        await asyncio.sleep(0.8)
        assert len(p.finished) == 1, "prefill leg ran to completion after the client left"

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
