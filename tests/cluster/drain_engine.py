"""A stand-in engine for the scale-down drain test: `vllm serve MODEL --port P --shutdown-timeout S ...`.

It plays what the pod lifecycle needs from vLLM and nothing of the KV path: /health, /v1/models and
/metrics answer; a completion streams `max_tokens` tokens one per TOKEN_S (a non-streamed one, the
router's prefill leg, answers after PREFILL_S). SIGTERM works as vLLM's `--shutdown-timeout` drain:
new requests are refused with 503, those in flight finish, then the process exits (at the latest
after the timeout). Every arrival, finish, refusal, the SIGTERM and the exit go as JSON lines, with
wall-clock times, to $DRAIN_EVENTS/<pod name>.jsonl for the test to read after the pod is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

TOKEN_S = 0.25
PREFILL_S = 0.2


class Engine:
    def __init__(self, events: Path, pod: str) -> None:
        self.pod = pod
        self.out = events.open("a", buffering=1)
        self.in_flight = 0
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    def log(self, ev: str, **kw: Any) -> None:
        self.out.write(json.dumps({"ev": ev, "t": time.time(), "pod": self.pod, **kw}) + "\n")

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def metrics(self, _: web.Request) -> web.Response:
        lines = [
            f"vllm:num_requests_running {self.in_flight}",
            "vllm:num_requests_waiting 0",
            "vllm:kv_cache_usage_perc 0",
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        body = await request.json()
        if self.draining:  # vLLM's engine core rejects adds once its shutdown started
            self.log("refused", rid=rid)
            return web.json_response({"error": {"message": "shutting down", "code": 503}}, status=503)
        self.in_flight += 1
        self.idle.clear()
        self.log("arrive", rid=rid, stream=bool(body.get("stream")))
        done = False
        try:
            if not body.get("stream"):
                await asyncio.sleep(PREFILL_S)
                done = True
                choice = {"index": 0, "text": "x", "finish_reason": "length"}
                return web.json_response({"id": rid, "choices": [choice]})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = int(body.get("max_tokens") or 16)
            for i in range(n):
                await asyncio.sleep(TOKEN_S)
                choice = {"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}
                await resp.write(f"data: {json.dumps({'id': rid, 'choices': [choice]})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            done = True
            return resp
        finally:
            self.in_flight -= 1
            self.log("finish", rid=rid, ok=done)  # not ok: the stream broke (client gone, cancelled)
            if self.in_flight == 0:
                self.idle.set()


async def serve(args: argparse.Namespace) -> None:
    pod = os.environ.get("HOSTNAME", "engine")
    engine = Engine(Path(os.environ["DRAIN_EVENTS"]) / f"{pod}.jsonl", pod)
    app = web.Application()
    app.router.add_get("/health", engine.health)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_post("/v1/completions", engine.complete)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, os.environ.get("KVFERRY_POD_IP", "0.0.0.0"), args.port).start()
    engine.log("started")
    term = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, term.set)
    await term.wait()
    engine.draining = True
    engine.log("sigterm", in_flight=engine.in_flight)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(engine.idle.wait(), args.shutdown_timeout)
    engine.log("exit", in_flight=engine.in_flight)
    await runner.cleanup()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--shutdown-timeout", type=float, default=0)
    args, _ = parser.parse_known_args(argv)  # the rest of vLLM's flags mean nothing here
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
