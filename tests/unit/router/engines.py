"""Test helper: small real aiohttp servers standing in for vLLM engines, and a router in front of them.

The stand-ins only record what they receive and answer as told; they prove the router's own logic
(leg bodies, shared request id, recompute, deadlines, errors, overload), not P/D itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from kvferry.router import dispatch
from kvferry.router.app import STATE, build_app
from kvferry.router.config import parse_config
from kvferry.router.state import RouterState

CHAT_PATH = "/v1/chat/completions"


def sse(event: Any) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class FakeEngine:
    """Records requests and answers per `mode`:

    ok; error500 / error400 / error<status> (that HTTP status); deep500 (a P/D leg gets 500 with a
    body nested 100,000 deep); huge (answers padded with 100 kB); stall (never answers); slow or
    slow:<s> (answers after 0.5 s or <s> s); error_event (a P/D leg gets status 200 and an SSE error
    event before any token, as vLLM does when the KV load fails; plain requests are served); breaks
    (a streamed P/D leg sends one token, then the connection drops, as when the engine is killed
    mid-answer); after_prefill (a P/D leg answers only once `peer` has finished the same request id,
    as a push D waits for its KV);
    orphaned (a P/D leg stops `peer`'s server, as a prefill process that died, and never answers, as
    a D waiting for KV from it; plain requests are served); endless (a P/D leg never ends: a stream
    sends a token every 20 ms, a plain answer never comes; `closed` records the request ids whose
    connection the router closed, as vLLM aborts a request whose client left).
    """

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name, self.mode = name, mode
        self.peer: FakeEngine | None = None
        self.first_id = 0  # the token id its 1-token answer reports (the stream's first is 0)
        self.seen: list[dict[str, Any]] = []
        self.finished: list[str] = []
        self.closed: list[str] = []
        self.metrics_text: str | None = None  # what GET /metrics serves (None: 404, as before)
        self.metrics_reads = 0
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post(CHAT_PATH, self.handle)
        self.server = TestServer(app, host="127.0.0.1")

    async def metrics(self, request: web.Request) -> web.Response:
        if self.metrics_text is None:
            raise web.HTTPNotFound()
        self.metrics_reads += 1
        await asyncio.sleep(0.05)  # a scrape takes a moment: concurrent readers overlap it
        return web.Response(text=self.metrics_text)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = request.headers.get("X-Request-Id", "")
        self.seen.append({"rid": rid, "body": body, "t": time.monotonic()})
        pd_leg = "kv_transfer_params" in body
        if self.mode == "endless" and pd_leg:
            return await self._endless(request, rid, bool(body.get("stream")))
        if self.mode == "stall" or (self.mode == "orphaned" and pd_leg):
            if self.mode == "orphaned" and self.peer is not None:
                while rid not in self.peer.finished:  # prefill answered its leg, then died
                    await asyncio.sleep(0.01)
                await self.peer.server.close()
            await asyncio.sleep(3600)
        if self.mode.startswith("slow"):
            await asyncio.sleep(float(self.mode.partition(":")[2] or 0.5))
        if self.mode == "after_prefill" and pd_leg:
            assert self.peer is not None
            while rid not in self.peer.finished:
                await asyncio.sleep(0.01)
        if self.mode.startswith("error") and self.mode[5:].isdigit():
            no = {"error": {"message": f"{self.name} says no"}}
            return web.json_response(no, status=int(self.mode[5:]))
        if self.mode == "deep500" and pd_leg:  # an error body no JSON parser should recurse into
            return web.Response(text="[" * 100_000, status=500)
        chat = request.path == CHAT_PATH
        if self.mode == "breaks" and pd_leg and body.get("stream"):
            return await self._stream(request, body, chat, cut=True)
        if self.mode == "error_event" and pd_leg:
            if not body.get("stream"):
                return web.json_response({"error": {"message": "kv load failed", "code": 500}}, status=500)
            return await self._stream(request, body, chat, fail=True)
        self.finished.append(rid)
        if body.get("stream"):
            return await self._stream(request, body, chat)
        kv = {"do_remote_prefill": True, "remote_engine_id": self.name, "remote_block_ids": [[1]]}
        ids = body.get("return_token_ids")  # then a 1-token answer: the first token of _stream's
        text = "from" if ids else f"from {self.name}"
        choice: dict[str, Any] = {"index": 0}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        if ids:
            choice["token_ids"] = [self.first_id]
        if self.mode == "huge":
            choice["padding"] = "x" * 100_000
        answer = {
            "id": f"cmpl-{rid}",
            "created": 1,
            "model": "tiny",
            "choices": [choice],
            "kv_transfer_params": kv,
        }
        return web.json_response(answer)

    async def _endless(self, request: web.Request, rid: str, stream: bool) -> web.StreamResponse:
        try:
            if not stream:
                await asyncio.sleep(3600)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(1_000_000):
                await resp.write(sse({"choices": [{"index": 0, "text": "x", "token_ids": [i]}]}))
                await asyncio.sleep(0.02)
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.closed.append(rid)
            raise

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, fail: bool = False, cut: bool = False
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:
            # vLLM's first chat chunk carries only the role; sent in two pieces (one event split
            # across reads) so the router must buffer partial events.
            role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for piece in (role[:17], role[17:]):
                await resp.write(piece)
                await asyncio.sleep(0.02)
        if fail:
            error = {"message": "Internal server error", "type": "InternalServerError", "code": 500}
            await resp.write(sse({"error": error}) + b"data: [DONE]\n\n")
            return resp
        for i, word in enumerate(("from", " ", self.name)):
            piece = {"delta": {"content": word}} if chat else {"text": word}
            await resp.write(sse({"choices": [{"index": 0, **piece, "token_ids": [i]}]}))
            await asyncio.sleep(0.05)
            if cut:  # the engine dies after its first token: the connection drops mid-stream
                assert request.transport is not None
                request.transport.abort()
                return resp
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(sse({"choices": [], "usage": {"completion_tokens": 3}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


def config(mode: str, p: FakeEngine, d: FakeEngine, **extra: Any) -> dict[str, Any]:
    def entry(e: FakeEngine, port: int) -> dict[str, Any]:
        return {"url": e.url, "engine_id": e.name, "side_host": "127.0.0.1", "side_port": port}

    deadlines = {"prefill_s": 2, "decode_first_token_s": 1, "transfer_s": 0.5, "total_s": 4}
    return {
        "mode": mode, "model": "tiny",
        **extra, "deadlines": {**deadlines, **extra.get("deadlines", {})},
        "discovery": {"static": {"prefill": [entry(p, 5600)], "decode": [entry(d, 5601)]}},
    }  # fmt: skip


Check = Callable[[TestClient, FakeEngine, FakeEngine], Awaitable[None]]


def run(mode: str, p_mode: str, d_mode: str, test: Check, api_key: str | None = None, **extra: Any) -> None:
    """Start P, D and a router (config overrides in `extra`), then run `test` against the router.
    The KV margin is cut to 0.1 s so that push-mode bounds after prefill fit a 4 s test deadline."""

    async def main() -> None:
        p, d = FakeEngine("prefill-0", p_mode), FakeEngine("decode-0", d_mode)
        p.peer, d.peer = d, p
        await p.server.start_server()
        await d.server.start_server()
        app = build_app(parse_config(config(mode, p, d, **extra)), api_key)
        client = TestClient(TestServer(app, host="127.0.0.1"))
        await client.start_server()
        try:
            await asyncio.wait_for(test(client, p, d), 30)
        finally:
            await client.close()
            await p.server.close()
            await d.server.close()

    margin = dispatch.KV_MARGIN_S
    dispatch.KV_MARGIN_S = 0.1
    try:
        asyncio.run(main())
    finally:
        dispatch.KV_MARGIN_S = margin


def router_state(client: TestClient) -> RouterState:
    return client.server.app[STATE]


def stream_text(raw: str) -> str:
    """The generated text in an SSE body (completion text or chat delta content)."""
    out = []
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)
