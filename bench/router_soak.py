"""Router hostile-input soak: hostile KV-event frames and disconnecting clients against one router.

    python bench/router_soak.py --frames 2000 --requests 2000 --concurrency 16 --seed 1 \
        --out bench/results/router_soak

One process, one event loop, as in production: the router app (served with app.SERVE_OPTIONS, as
`kvferry router` serves it), a stand-in prefill and decode (aiohttp servers that answer P/D legs and
record which are still open), and a ZMQ publisher standing in for decode's KV-event endpoint. The
seed fixes the frames and the requests:

- frames (--frames): a seeded mix of well-formed batches and hostile ones: huge batches (32,768 blocks
  in events of 4,096), frames past the 1 MiB cap, garbage payloads, wrong frame counts, bad sequence
  frames, hashes of 100 kB, more events than a batch may hold, nesting 200,000 deep,
  floods of removals, unknown event types, sequence numbers that jump ahead or go back (restarts).
- requests (--requests, --concurrency at once): aggregated (non-streaming), streamed and plain
  (logprobs: decode answers non-streaming) completions; two in three clients leave part-way
  (after 0-50 ms, or after 1-3 streamed chunks), the rest read the whole answer.

At the end: a crash is an answer without an OpenAI error body (aiohttp's own 500 after an exception
in a handler) or a feed task that died; a leak is an in-flight slot, a detached prefill or a leg the
stand-in engines still hold open once every client is done (after a bounded settle). The loop's own
lag is measured by a 5 ms ticker, over the first half of the frames alone (the feed's share) and over
the rest sent with the clients (one loop serves router, stand-ins and clients, so it is busy); the
most blocks applied in one loop slice by wrapping the index.
tests/unit/router/test_router_hostile_soak.py runs the short form in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web
from kvferry.router import kvevents
from kvferry.router.app import SERVE_OPTIONS, STATE, build_app
from kvferry.router.config import parse_config
from kvferry.router.prefix import prompt_keys
from kvferry.tools.stats import percentile

BLOCK = 16
HOSTILE = ("huge", "oversized", "garbage", "frames", "seq", "hash", "events", "deep", "removed",
           "unknown", "gap", "restart")  # fmt: skip
_enc = msgspec.msgpack.Encoder()


@dataclass
class Figures:
    frames: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)  # by outcome
    blocks_applied: int = 0
    max_blocks_per_slice: int = 0
    max_loop_lag_ms: float = 0.0  # frames alone (the first half of them): the feed's share
    p99_loop_lag_ms: float = 0.0
    max_loop_lag_loaded_ms: float = 0.0  # the other half with the clients (one loop serves them all)
    p99_loop_lag_loaded_ms: float = 0.0
    max_slice_cpu_ms: float = 0.0  # the longest one slice (or one frame's decode) held the loop, in CPU
    max_decode_cpu_ms: float = 0.0  # time: independent of what else the host runs
    dropped: dict[str, float] = field(default_factory=dict)
    crashes: int = 0
    leaked: int = 0
    feed_alive: bool = False
    seconds: float = 0.0


class StandIn:
    """A stand-in engine: P/D legs answered (decode streams one token per 5 ms); `open` holds the
    request ids of legs not yet ended, `closed` counts those the router closed before their end."""

    def __init__(self, role: str) -> None:
        self.role, self.open, self.closed = role, set[str](), 0
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body, rid = await request.json(), request.headers.get("X-Request-Id", "")
        self.open.add(rid)
        try:
            n = int(body.get("max_tokens", 1))
            if self.role == "prefill" or not body.get("stream"):
                await asyncio.sleep(0.005 * n if self.role == "decode" else 0.001)
                choice = {"index": 0, "text": "x" * n, "finish_reason": "length"}
                return web.json_response({"id": rid, "created": 1, "model": "tiny", "choices": [choice],
                                          "kv_transfer_params": {"do_remote_prefill": True}})  # fmt: skip
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                event = {"choices": [{"index": 0, "text": "x", "token_ids": [i]}]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
                await asyncio.sleep(0.005)
            usage = {"choices": [], "usage": {"completion_tokens": n}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return resp
        except asyncio.CancelledError:  # the router closed the leg
            self.closed += 1
            raise
        except ConnectionResetError:  # closed while this stand-in was writing to it
            self.closed += 1
            return web.Response(status=499)
        finally:
            self.open.discard(rid)


def _stored(hashes: list[Any], parent: Any, tokens: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU"}  # fmt: skip


def _batch(events: list[Any]) -> bytes:
    return _enc.encode([1.0, events, 0])


class Publisher:
    """Decode's KV-event endpoint, played by the soak: `frame(kind)` builds and sends one frame."""

    def __init__(self, path: str, rng: random.Random) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 64)
        self.pub.bind(path)
        self.rng, self.seq, self.base = rng, 0, 1 << 20
        self.payloads = self._payloads()

    async def send(self, payload: bytes, parts: list[bytes] | None = None) -> None:
        seq = self.seq.to_bytes(8, "big", signed=True)
        self.seq += 1
        await self.pub.send_multipart(parts if parts is not None else [b"kv", seq, payload])

    @staticmethod
    def _payloads() -> dict[str, bytes]:
        """The large hostile payloads, built once before the clock starts (building them costs the
        soak's own loop tens of ms, which its lag figure would otherwise blame on the router)."""
        per = 1 << 12  # kvevents.MAX_EVENT_BLOCKS
        tokens = [7] * (per * BLOCK)
        huge = [
            _stored(list(range(i * per, (i + 1) * per)), i * per - 1 if i else None, tokens) for i in range(8)
        ]
        return {
            "huge": _batch(huge),  # 32,768 chained blocks in events of 4,096 (~0.6 MB, under the 1 MiB cap)
            "oversized": b"\x00" * (2 << 20),  # past the 1 MiB cap
            "hash": _batch([_stored([b"h" * 100_000], None, [1] * BLOCK)]),
            "events": _batch([{"type": "X"}] * ((1 << 16) + 1)),  # more than MAX_BATCH_EVENTS
            "deep": b"\x93" + _enc.encode(1.0) + b"\x91" + b"\x91" * 200_000 + b"\x90\x00",
            "removed": _batch([{"type": "BlockRemoved", "block_hashes": list(range(per))}] * 16),
            "unknown": _batch([{"type": f"Newer{i}", "x": i} for i in range(1000)]),
        }

    async def frame(self, kind: str) -> None:
        rng = self.rng
        if kind in self.payloads:
            return await self.send(self.payloads[kind])
        if kind == "ok":
            tokens = [rng.randrange(50_000) for _ in range(BLOCK * 4)]
            self.base += 4
            return await self.send(_batch([_stored(list(range(self.base, self.base + 4)), None, tokens)]))
        if kind == "garbage":
            return await self.send(rng.randbytes(rng.randrange(1, 4096)))
        if kind == "frames":
            return await self.send(b"", parts=[b"kv", b"x"])
        if kind == "seq":
            return await self.send(b"", parts=[b"kv", b"abc", _batch([])])
        if kind == "gap":
            self.seq += rng.randrange(2, 10_000)
            return await self.frame("ok")
        if kind == "restart":
            self.seq = 0
            return await self.frame("ok")
        raise ValueError(kind)

    def close(self) -> None:
        self.pub.close(linger=0)
        self.ctx.destroy(linger=0)


REQUESTS = {
    "aggregated": {"prompt": "hello", "max_tokens": 20},
    "streamed": {"prompt": "hello", "max_tokens": 20, "stream": True},
    "plain": {"prompt": "hello", "max_tokens": 20, "logprobs": 1},
}


@dataclass(frozen=True)
class Client:
    kind: str
    leave: bool
    after_s: float  # aggregated and plain: leave after this long
    chunks: int  # streamed: leave after this many reads


def plan(requests: int, rng: random.Random) -> list[Client]:
    """The seeded clients: two in three leave part-way."""
    kinds = list(REQUESTS)
    return [Client(rng.choice(kinds), rng.random() < 2 / 3, rng.uniform(0, 0.05), rng.randrange(1, 4))
            for _ in range(requests)]  # fmt: skip


async def _client(session: aiohttp.ClientSession, url: str, client: Client, figures: Figures) -> None:
    kind, leave, after_s, chunks = client.kind, client.leave, client.after_s, client.chunks

    async def ask() -> str:
        async with session.post(url + "/v1/completions", json=REQUESTS[kind]) as resp:
            if kind == "streamed" and resp.status == 200:
                got = 0
                async for _ in resp.content.iter_any():
                    got += 1
                    if leave and got >= chunks:
                        raise asyncio.CancelledError  # the client hangs up mid-stream
                return "ok"
            body = await resp.read()
            if resp.status == 200:
                return "ok"
            try:
                error = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return "crash"  # not an OpenAI error body: an exception escaped a handler
            return f"error_{resp.status}" if error else "crash"

    task = asyncio.create_task(ask())
    if leave and kind != "streamed":
        done, _ = await asyncio.wait({task}, timeout=after_s)
        if not done:
            task.cancel()
    try:
        outcome = await task
    except asyncio.CancelledError:
        outcome = "left"
    figures.requests[outcome] = figures.requests.get(outcome, 0) + 1
    figures.crashes += outcome == "crash"


def _timed(figures: Figures) -> tuple[Any, Any]:
    """Wrap kvevents' decode and slices to measure each one's CPU time (thread time: a loaded host
    delays the loop, but does not lengthen this); returns the originals to restore."""
    real_decode, real_slices = kvevents.decode, kvevents.EngineBlocks.slices

    def decode(payload: bytes) -> kvevents.Batch:
        t0 = time.thread_time()
        try:
            return real_decode(payload)
        finally:
            figures.max_decode_cpu_ms = max(figures.max_decode_cpu_ms, (time.thread_time() - t0) * 1e3)

    def slices(self: kvevents.EngineBlocks, *args: Any, **kw: Any) -> Iterator[kvevents.Change] | None:
        parts = real_slices(self, *args, **kw)
        if parts is None:
            return None

        def timed() -> Iterator[kvevents.Change]:
            while True:
                t0 = time.thread_time()
                change = next(parts, None)
                figures.max_slice_cpu_ms = max(figures.max_slice_cpu_ms, (time.thread_time() - t0) * 1e3)
                if change is None:
                    return
                yield change

        return timed()

    kvevents.decode, kvevents.EngineBlocks.slices = decode, slices  # type: ignore[method-assign]
    return real_decode, real_slices


async def soak(frames: int, requests: int, concurrency: int, seed: int) -> Figures:
    """Run the soak; returns its figures (the caller judges them)."""
    rng, figures, loop = random.Random(seed), Figures(), asyncio.get_running_loop()
    clients_plan = plan(requests, random.Random(seed + 1))  # apart from the frames' draws: both seeded
    started = loop.time()
    with tempfile.TemporaryDirectory() as tmp:
        prefill, decode = StandIn("prefill"), StandIn("decode")
        p_url, d_url = await prefill.start(), await decode.start()
        publisher = Publisher(f"ipc://{tmp}/pub", rng)

        def entry(role: str, url: str) -> dict[str, Any]:
            e = {"url": url, "engine_id": f"{role}-0", "side_host": "127.0.0.1", "side_port": 5600}
            return {**e, "kv_events": f"ipc://{tmp}/pub"} if role == "decode" else e

        cfg = {"mode": "kvferry", "model": "tiny", "routing": {"block_tokens": BLOCK},
               "limits": {"max_in_flight_per_engine": 4 * concurrency},
               "deadlines": {"prefill_s": 10, "decode_first_token_s": 10, "transfer_s": 1, "total_s": 30},
               "discovery": {"static": {"prefill": [entry("prefill", p_url)],
                                        "decode": [entry("decode", d_url)]}}}  # fmt: skip
        app = build_app(parse_config(cfg))
        runner = web.AppRunner(app, **SERVE_OPTIONS)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        state = app[STATE]
        index, real_stored, real_removed = state.index, state.index.stored, state.index.removed

        def stored(engine: str, keys: Any) -> None:
            real_stored(engine, keys)
            figures.blocks_applied += len(keys)
            figures.max_blocks_per_slice = max(figures.max_blocks_per_slice, len(keys))

        def removed(engine: str, keys: Any) -> None:
            real_removed(engine, keys)
            figures.max_blocks_per_slice = max(figures.max_blocks_per_slice, len(keys))

        index.stored, index.removed = stored, removed
        stop = asyncio.Event()

        lags: list[float] = []
        alone: list[float] = []

        async def ticker() -> None:  # the loop's own lag: how late a 5 ms sleep wakes
            while not stop.is_set():
                t0 = loop.time()
                await asyncio.sleep(0.005)
                lags.append((loop.time() - t0 - 0.005) * 1e3)

        async def publish(count: int) -> None:
            for _ in range(count):
                kind = rng.choice(HOSTILE) if rng.random() < 0.5 else "ok"  # half of them hostile
                figures.frames[kind] = figures.frames.get(kind, 0) + 1
                await publisher.frame(kind)
                await asyncio.sleep(0.002)

        async def clients(session: aiohttp.ClientSession) -> None:
            slots = asyncio.Semaphore(concurrency)

            async def one(client: Client) -> None:
                async with slots:
                    await _client(session, url, client, figures)

            await asyncio.gather(*(one(c) for c in clients_plan))

        tick = asyncio.create_task(ticker())
        originals = _timed(figures)
        try:
            async with aiohttp.ClientSession() as session:
                await _wait_subscribed(publisher, index, d_url)
                await asyncio.wait_for(publish(frames // 2), 600)  # the feed alone: its lag
                await asyncio.sleep(0.5)  # what is queued is applied
                alone[:], lags[:] = lags, []
                await asyncio.wait_for(asyncio.gather(publish(frames - frames // 2), clients(session)), 600)
                figures.feed_alive = await _feed_follows(publisher, index, d_url, state)
                figures.leaked = await _settle(state, prefill, decode)
                async with session.post(url + "/v1/completions", json=REQUESTS["aggregated"]) as resp:
                    figures.crashes += resp.status != 200  # the router still serves after it all
        finally:
            kvevents.decode, kvevents.EngineBlocks.slices = originals  # type: ignore[method-assign]
            stop.set()
            await tick
            metrics = state.metrics.render().decode()
            publisher.close()
            await runner.cleanup()
            await prefill.runner.cleanup()
            await decode.runner.cleanup()
        for line in metrics.splitlines():
            if line.startswith("kvferry_router_kv_event_dropped_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                figures.dropped[reason] = float(line.rsplit(" ", 1)[1])
    figures.seconds = round(loop.time() - started, 1)
    figures.max_slice_cpu_ms = round(figures.max_slice_cpu_ms, 1)
    figures.max_decode_cpu_ms = round(figures.max_decode_cpu_ms, 1)
    figures.p99_loop_lag_ms, figures.max_loop_lag_ms = _p99_max(alone)
    figures.p99_loop_lag_loaded_ms, figures.max_loop_lag_loaded_ms = _p99_max(lags)
    return figures


async def _wait_subscribed(publisher: Publisher, index: Any, url: str) -> None:
    """PUB drops frames sent before the SUB's subscription arrives: resend a probe until it lands."""
    tokens = [1] * BLOCK
    keys = prompt_keys(tokens, BLOCK, 4.0).keys
    for _ in range(400):
        if index.match(url, keys):
            return
        await publisher.send(_batch([_stored([0], None, tokens)]))
        await asyncio.sleep(0.05)
    raise RuntimeError("the router never subscribed to the stand-in publisher")


async def _feed_follows(publisher: Publisher, index: Any, url: str, state: dict[str, Any]) -> bool:
    """After every hostile frame, the feed still applies a well-formed batch (within ~20 s)."""
    tokens = [3] * (2 * BLOCK)
    keys = prompt_keys(tokens, BLOCK, 4.0).keys
    for _ in range(400):
        if index.match(url, keys) == 2:
            return bool(state.serving.feed._tasks)
        await publisher.send(_batch([_stored([b"end0", b"end1"], None, tokens)]))
        await asyncio.sleep(0.05)
    return False


async def _settle(state: dict[str, Any], prefill: StandIn, decode: StandIn) -> int:
    """What is still held once the clients are gone (after at most ~10 s): in-flight slots, detached
    prefills, legs the engines still have open."""
    held = 0
    for _ in range(200):
        slots = sum(s.value for m in state.metrics.in_flight.collect() for s in m.samples)
        held = int(slots) + len(state.serving.dispatcher.detached) + len(prefill.open) + len(decode.open)
        if held == 0:
            return 0
        await asyncio.sleep(0.05)
    detached = len(state.serving.dispatcher.detached)
    print(f"held: in-flight slots {slots:g}, detached prefills {detached}, legs open at prefill "
          f"{len(prefill.open)} and decode {len(decode.open)}", file=sys.stderr)  # fmt: skip
    return held


def report(figures: Figures, args: argparse.Namespace) -> str:
    judged = "PASS" if figures.crashes == 0 and figures.leaked == 0 and figures.feed_alive else "FAIL"
    f = figures
    rows = [
        f"# Router hostile-input soak ({judged})",
        "",
        f"`python bench/router_soak.py --frames {args.frames} --requests {args.requests} "
        f"--concurrency {args.concurrency} --seed {args.seed}`",
        "",
        "| figure | value |",
        "|---|---|",
        f"| frames sent (by kind) | {sum(figures.frames.values())} ({_pairs(figures.frames)}) |",
        f"| requests (by outcome) | {sum(figures.requests.values())} ({_pairs(figures.requests)}) |",
        f"| blocks applied / most in one loop slice | {f.blocks_applied} / {f.max_blocks_per_slice} |",
        f"| dropped input (kv_event_dropped_total) | {_pairs(figures.dropped)} |",
        f"| longest loop hold, CPU time: one slice / one frame's decode | {f.max_slice_cpu_ms} / "
        f"{f.max_decode_cpu_ms} ms |",
        f"| loop lag, frames alone: p99 / max (5 ms ticker) | {f.p99_loop_lag_ms} / {f.max_loop_lag_ms} ms |",
        f"| loop lag, frames and clients: p99 / max | {f.p99_loop_lag_loaded_ms} / "
        f"{f.max_loop_lag_loaded_ms} ms |",
        f"| crashes / leaked entries / feed alive | {f.crashes} / {f.leaked} / {f.feed_alive} |",
        f"| wall time | {figures.seconds} s |",
    ]
    return "\n".join(rows) + "\n"


def _p99_max(lags: list[float]) -> tuple[float, float]:
    if not lags:
        return 0.0, 0.0
    return round(percentile(lags, 99), 1), round(max(lags), 1)


def _pairs(counts: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write <out>.md and <out>.json")
    args = parser.parse_args(argv)
    figures = asyncio.run(soak(args.frames, args.requests, args.concurrency, args.seed))
    text = report(figures, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(asdict(figures), indent=1) + "\n")
    return 0 if "PASS" in text.splitlines()[0] else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
