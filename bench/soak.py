"""Soak bench: thousands of requests through the router (mode kvferry) while engines are killed and
restarted, paused mid-transfer and clients hang up; every request must end, clearly, within its deadline.

    python bench/soak.py --requests 3000 --concurrency 8 --rate 4 --faults 12 --cancels 60 --seed 1

One P/D stack (tools/pdstack.py: prefill on core 0, decode on core 1, the router) on loopback. The
seed fixes the request mix (completions or chat, streamed or not, prompt and output lengths), which
requests the client cancels, and each fault with the number of sent requests at which it fires:

- kill-prefill / kill-decode: SIGKILL of the engine's process group, then a restart with the same
  engine id, HTTP port and side channel. The engine is down from the kill until /health answers again.
- stop-prefill: SIGSTOP of prefill's process group for --stop-seconds, then SIGCONT: a peer that stops
  answering mid-WRITE (it fires while requests are in flight). Down from SIGSTOP to SIGCONT.
- client cancels (--cancels): a streamed request closed after its first 1-3 chunks (mid-stream), or
  one in three closed after 0.05-1 s whatever it got by then (before its first token, usually).

Faults run one after another, and each is followed by at least --tail requests on the whole stack
before the next fires (later than planned if need be); the run goes on past --requests until --tail
requests were sent after the last one, so the first requests after every restart are measured.

Every request is classified:
- ok: a complete answer: HTTP 200 and `max_tokens` completion tokens (`ignore_eos`); a stream must
  end with its usage chunk and `data: [DONE]`.
- recomputed: the same with the `X-Kvferry-Recomputed` header (the router recomputed on one engine).
- error: a clear error: an HTTP status with an OpenAI error body (`{"error": {"message", ...}}`), or
  an SSE `data: {"error": ...}` event, within total_s + --slack.
- cancelled: the client left on purpose before the end (intended).
- lost: anything else: no end within total_s + --slack, a stream cut without [DONE] or an error event,
  a transport error, an error status without an OpenAI error body, or a 200 with too few tokens.

An error is *avoidable* when both hold:
  (a) the client had received no token of the answer: for a stream, no `choices` chunk came before
      the error; a non-streamed request never has one (the router holds the whole answer until its
      end, so it could still recompute);
  (b) at least one engine of the pair (prefill or decode) was up the whole time the request ran, from
      sending it to its end: an engine is down from its kill until its restart answers /health, and
      from SIGSTOP to SIGCONT.
Then a local recompute on that engine was possible and the client should have got an answer. An
error after the first token of a stream (e.g. decode killed mid-stream) is neither avoidable nor lost.

After the last request, every gauge must be back to 0 within --settle seconds (PdStack.gauges():
vLLM's running, waiting and KV cache usage and every kvferry_pending series on both engines, the
router's in-flight legs and detached prefills). The RSS (process plus children) of router, prefill and
decode is sampled every 2 s (MemoryWatch: start, peak, end, growth of the incarnation alive at the end,
and over its second half). /dev/shm files of killed engines that nobody maps are counted, then removed.

Prints a table and a JSON summary (soak_report.py), writes OUT.json and OUT.md (--out, default
bench/results/soak), and exits 1 when lost > 0, avoidable > 0, a gauge is not back to 0 or an engine
exited by itself (2 when the stack could not run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kvferry.local.tinymodel import ensure
from kvferry.tools.pdstack import ENGINE_ROLES, MemoryWatch, PdStack, kvferry_connector_available
from soak_report import passed, summarize, table

FAULT_KINDS = ("kill-prefill", "kill-decode", "stop-prefill")
DEADLINES = {"prefill_s": 15.0, "decode_first_token_s": 15.0, "transfer_s": 10.0, "total_s": 40.0}
WORDS = ("ferry", "river", "cache", "block", "prefill", "decode", "wide", "carry", "across", "bank")
RSS_EVERY_S = 2.0


@dataclass
class Config:
    requests: int = 100
    concurrency: int = 4
    rate: float = 2.0  # Poisson arrivals per second; 0: as fast as the concurrency allows
    faults: int = 3
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    plan: tuple[str, ...] = ()  # explicit fault kinds in this order (overrides faults/fault_kinds)
    fault_window: tuple[float, float] = (0.05, 0.85)  # faults fire between these fractions of requests
    stop_s: tuple[float, float] = (2.0, 10.0)
    cancels: int = 2
    seed: int = 0
    lengths: tuple[int, ...] = (5, 129, 300, 700, 1500)
    max_tokens: tuple[int, int] = (8, 48)
    chat_frac: float = 0.3
    stream_frac: float = 0.5
    deadlines: dict[str, float] = field(default_factory=lambda: dict(DEADLINES))
    router: dict[str, Any] = field(default_factory=dict)  # more router.yaml keys, e.g. limits
    slack_s: float = 10.0
    tail: int = 10
    settle_s: float = 90.0
    ready_timeout_s: float = 600.0


@dataclass
class Req:
    index: int
    path: str
    stream: bool
    length: int
    max_tokens: int
    cancel: str = ""  # "", "mid-stream" (after `cancel_after` chunks), "timed" (after cancel_after s)
    cancel_after: float = 0.0


@dataclass
class Fault:
    kind: str
    at: int  # planned: fires once this many requests were sent (and --tail after the previous fault)
    stop_s: float = 0.0
    fired_at: int = 0
    started: float = 0.0
    detail: str = ""


@dataclass
class Outcome:
    req: Req
    result: str = "pending"  # ok | recomputed | error | cancelled | lost
    detail: str = ""
    status: int = 0
    code: str = ""  # error code, or the recompute reason
    start: float = 0.0
    end: float = 0.0
    first_token: float | None = None
    avoidable: bool = False


def draw_request(rng: random.Random, index: int, cfg: Config, cancel: bool) -> Req:
    req = Req(
        index, "/v1/chat/completions" if rng.random() < cfg.chat_frac else "/v1/completions",
        rng.random() < cfg.stream_frac, rng.choice(cfg.lengths), rng.randint(*cfg.max_tokens),
    )  # fmt: skip
    if cancel:
        req.stream, req.max_tokens = True, max(req.max_tokens, 32)
        req.cancel = "timed" if rng.random() < 1 / 3 else "mid-stream"
        req.cancel_after = rng.uniform(0.05, 1.0) if req.cancel == "timed" else rng.randint(1, 3)
    return req


def make_plan(cfg: Config) -> tuple[list[Req], list[Fault]]:
    rng = random.Random(cfg.seed)
    cancels = set(rng.sample(range(cfg.requests), min(cfg.cancels, cfg.requests)))
    reqs = [draw_request(rng, i, cfg, i in cancels) for i in range(cfg.requests)]
    if cfg.plan:
        kinds = list(cfg.plan)
    else:
        order = rng.sample(list(cfg.fault_kinds), len(cfg.fault_kinds))
        kinds = [order[j % len(order)] for j in range(cfg.faults)]
    lo = int(cfg.fault_window[0] * cfg.requests)
    hi = max(int(cfg.fault_window[1] * cfg.requests), lo + len(kinds))
    ats = sorted(rng.sample(range(lo, hi), len(kinds)))
    stops = [rng.uniform(*cfg.stop_s) if k.startswith("stop") else 0.0 for k in kinds]
    return reqs, [Fault(k, at, stop) for k, at, stop in zip(kinds, ats, stops, strict=True)]


def request_body(req: Req, seed: int) -> dict[str, Any]:
    rng = random.Random(seed * 1_000_003 + req.index)
    body: dict[str, Any] = {"model": "tiny", "max_tokens": req.max_tokens, "temperature": 0}
    body.update(ignore_eos=True, stream=req.stream)
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.path.endswith("/chat/completions"):  # ~2.2 tokens per word with the tiny model's tokenizer
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, req.length // 3)))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = [rng.randrange(10, 2010) for _ in range(req.length)]
    return body


def up_whole_time(down: list[list[float | None]], t0: float, t1: float) -> bool:
    """No down interval [a, b] (b None: still down) overlaps [t0, t1]."""
    return not any(a <= t1 and (b is None or b >= t0) for a, b in down)  # type: ignore[operator]


def is_avoidable(o: Outcome, down: dict[str, list[list[float | None]]]) -> bool:
    """See the module docstring: a clear error before any token while one engine was up throughout."""
    no_token = not o.req.stream or o.first_token is None
    return o.result == "error" and no_token and any(up_whole_time(d, o.start, o.end) for d in down.values())


def error_of(o: Outcome, content: bytes) -> None:
    """Classify a non-200 answer: clear with an OpenAI error body, lost without one."""
    try:
        err = json.loads(content)["error"]
        o.result, o.code, o.detail = "error", str(err.get("code") or ""), str(err["message"])[:400]
    except (ValueError, KeyError, TypeError):
        o.result, o.detail = "lost", f"status {o.status} without an OpenAI error body: {content[:200]!r}"


class Soak:
    def __init__(self, cfg: Config, stack: PdStack) -> None:
        self.cfg, self.stack = cfg, stack
        self.reqs, self.faults = make_plan(cfg)
        self.tail_rng = random.Random(f"{cfg.seed}-tail")
        self.down: dict[str, list[list[float | None]]] = {r: [] for r in ENGINE_ROLES}
        self.outcomes: list[Outcome] = []
        self.sent = 0
        self.sent_after_faults: int | None = None  # requests sent when the last fault ended
        self.memory = MemoryWatch(stack)

    async def run_faults(self) -> None:
        try:
            after = 0
            for f in self.faults:
                while self.sent < max(f.at, after + self.cfg.tail):
                    await asyncio.sleep(0.05)
                f.fired_at = self.sent
                await asyncio.to_thread(self._fault, f)
                after = self.sent
                print(f"  fault {f.kind} at request {f.fired_at}: {f.detail}", flush=True)
        finally:
            self.sent_after_faults = self.sent

    def _fault(self, f: Fault) -> None:
        role, pid = f.kind.split("-", 1)[1], self.stack.pids()[f.kind.split("-", 1)[1]]
        window: list[float | None] = [time.monotonic(), None]
        f.started = window[0]  # type: ignore[assignment]
        self.down[role].append(window)
        if f.kind.startswith("kill"):
            self.stack.kill(role)
            self.stack.restart(role, self.cfg.ready_timeout_s)
            f.detail = f"pid {pid} killed; healthy again after {time.monotonic() - f.started:.1f}s"
        else:
            self.stack.pause(role)
            time.sleep(f.stop_s)
            self.stack.resume(role)
            f.detail = f"pid {pid} stopped for {f.stop_s:.1f}s"
        window[1] = time.monotonic()

    async def dispatch(self, client: httpx.AsyncClient, faults: asyncio.Task[None]) -> None:
        arrivals, sem = random.Random(f"{self.cfg.seed}-arrivals"), asyncio.Semaphore(self.cfg.concurrency)
        tasks: list[asyncio.Task[None]] = []
        next_at = time.monotonic()
        while True:
            if faults.done() and faults.exception() is not None:
                break  # a restart failed: the run ends, the error is raised by the caller
            if self.sent >= len(self.reqs):
                if self.sent_after_faults is not None and self.sent - self.sent_after_faults >= self.cfg.tail:
                    break
                self.reqs.append(draw_request(self.tail_rng, self.sent, self.cfg, False))
            if self.cfg.rate > 0:
                next_at += arrivals.expovariate(self.cfg.rate)
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await sem.acquire()
            tasks.append(asyncio.create_task(self.one(client, self.reqs[self.sent], sem)))
            self.sent += 1
            if self.sent % 100 == 0:
                done = Counter(o.result for o in self.outcomes)
                print(f"  sent {self.sent}: {dict(done)}", flush=True)
        await asyncio.gather(*tasks)

    async def one(self, client: httpx.AsyncClient, req: Req, sem: asyncio.Semaphore) -> None:
        o = Outcome(req, start=time.monotonic())
        limit = self.cfg.deadlines["total_s"] + self.cfg.slack_s
        try:
            bound = req.cancel_after if req.cancel == "timed" else limit
            await asyncio.wait_for(self._send(client, req, o), bound)
        except asyncio.TimeoutError:
            if req.cancel == "timed":
                o.result, o.detail = "cancelled", f"client left after {req.cancel_after:.2f}s"
            else:
                o.result, o.detail = "lost", f"no end within total_s + slack = {limit:g}s"
        except httpx.HTTPError as exc:
            o.result, o.detail = "lost", f"transport error: {exc!r}"[:400]
        finally:
            sem.release()
        o.end = time.monotonic()
        o.avoidable = is_avoidable(o, self.down)
        self.outcomes.append(o)

    async def _send(self, client: httpx.AsyncClient, req: Req, o: Outcome) -> None:
        url, body = self.stack.url + req.path, request_body(req, self.cfg.seed)
        if not req.stream:
            resp = await client.post(url, json=body)
            o.status = resp.status_code
            if resp.status_code != 200:
                return error_of(o, resp.content)
            try:
                tokens = resp.json()["usage"]["completion_tokens"]
            except (ValueError, KeyError, TypeError):
                tokens = None
            return self._answer(o, req, resp.headers, tokens)
        async with client.stream("POST", url, json=body) as resp:
            o.status = resp.status_code
            if resp.status_code != 200:
                return error_of(o, await resp.aread())
            chunks, tokens, done = 0, None, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True  # read on to the end of the body, as OpenAI clients do
                    continue
                try:
                    event = json.loads(line[6:])
                except ValueError:
                    o.result, o.detail = "lost", f"not an SSE JSON event: {line[:200]!r}"
                    return None
                if isinstance(event.get("error"), dict):
                    err = event["error"]
                    o.result, o.code = "error", str(err.get("code") or "")
                    o.detail = f"SSE error event after {chunks} chunks: {str(err.get('message'))[:400]}"
                    return None
                if event.get("choices"):
                    chunks += 1
                    o.first_token = o.first_token or time.monotonic()
                    if req.cancel == "mid-stream" and chunks >= req.cancel_after:
                        o.result, o.detail = "cancelled", f"client left after {chunks} chunks"
                        return None  # leaving the block closes the connection
                if event.get("usage"):
                    tokens = event["usage"].get("completion_tokens")
            if not done:
                o.result, o.detail = "lost", f"stream cut after {chunks} chunks without [DONE] or an error"
                return None
            return self._answer(o, req, resp.headers, tokens)

    def _answer(self, o: Outcome, req: Req, headers: httpx.Headers, tokens: int | None) -> None:
        if tokens != req.max_tokens:
            o.result, o.detail = "lost", f"answer with {tokens} completion tokens, asked {req.max_tokens}"
            return
        o.code = headers.get("x-kvferry-recomputed", "")
        o.result = "recomputed" if o.code else "ok"

    async def rss_loop(self) -> None:
        while True:
            await asyncio.to_thread(self.memory.sample)
            await asyncio.sleep(RSS_EVERY_S)

    async def run(self) -> None:
        self.memory.sample()
        limits = httpx.Limits(max_connections=self.cfg.concurrency + 8)
        rss = asyncio.create_task(self.rss_loop())
        faults = asyncio.create_task(self.run_faults())
        try:
            async with httpx.AsyncClient(timeout=None, limits=limits) as client:
                await self.dispatch(client, faults)
            await faults  # raises when a restart failed
        finally:
            faults.cancel()  # no-op once done
            rss.cancel()
            await asyncio.gather(faults, rss, return_exceptions=True)


def run(cfg: Config, model: Path, workdir: Path, stack: PdStack | None = None) -> dict[str, Any]:
    """Soak a kvferry stack, settle, summarize. Without `stack` one is started here and every process
    stopped by PID at the end; a given (live, kvferry) stack gets a router of the soak's config and is
    left running."""
    own = stack is None
    if stack is None:
        stack = PdStack("kvferry", model, workdir, deadlines=cfg.deadlines, router_extra=cfg.router)
        print(f"== starting P/D stack in {workdir}", flush=True)
        stack.start(cfg.ready_timeout_s)
    else:
        stack.reroute(cfg.deadlines, cfg.router)
    soak = Soak(cfg, stack)
    try:
        faults = [(f.kind, f.at) for f in soak.faults]
        print(f"== soak: {len(soak.reqs)} requests, faults {faults}", flush=True)
        t0 = time.monotonic()
        asyncio.run(soak.run())
        gauges, settle_s = stack.settle(cfg.settle_s)
        soak.memory.sample()
        summary = summarize(soak, gauges, settle_s, time.monotonic() - t0)
        return summary | {"pass": passed(summary)}
    finally:
        if own:
            stack.stop()
            stack.remove_orphan_shm()  # only files the engines this run killed had mapped


def _pair(text: str, kind: type = float) -> tuple[Any, ...]:
    return tuple(kind(x) for x in text.split(",", 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=Config.requests)
    p.add_argument("--concurrency", type=int, default=Config.concurrency)
    p.add_argument("--rate", type=float, default=Config.rate, help="arrivals/s (Poisson); 0: closed loop")
    p.add_argument("--faults", type=int, default=Config.faults)
    p.add_argument("--fault-kinds", default=",".join(FAULT_KINDS))
    p.add_argument("--plan", default="", help="fault kinds in this order, e.g. stop-prefill,kill-prefill")
    p.add_argument("--fault-window", type=_pair, default=Config.fault_window, help="e.g. 0.05,0.85")
    p.add_argument("--stop-seconds", type=_pair, default=Config.stop_s, help="SIGSTOP length range")
    p.add_argument("--cancels", type=int, default=None, help="client cancels (default 2%% of requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default=",".join(map(str, Config.lengths)), help="prompt tokens")
    p.add_argument("--max-tokens", type=lambda t: _pair(t, int), default=Config.max_tokens)
    p.add_argument("--deadlines", type=json.loads, default={}, help="router deadlines (JSON) to change")
    p.add_argument("--router-config", type=json.loads, default={}, help='e.g. {"limits": {...}}')
    p.add_argument("--slack", type=float, default=Config.slack_s, help="seconds past total_s = lost")
    p.add_argument("--tail", type=int, default=Config.tail, help="requests after each fault ends")
    p.add_argument("--settle", type=float, default=Config.settle_s, help="seconds for gauges to reach 0")
    p.add_argument("--workdir", type=Path, default=None, help="logs (default: a new temporary folder, kept)")
    p.add_argument("--out", type=Path, default=Path("bench/results/soak"))
    a = p.parse_args(argv)
    kinds = tuple(k for k in (a.plan or a.fault_kinds).split(",") if k)
    if unknown := sorted(set(kinds) - set(FAULT_KINDS)):
        p.error(f"unknown fault kind(s) {unknown}; choose from {list(FAULT_KINDS)}")
    cfg = Config(
        requests=a.requests, concurrency=a.concurrency, rate=a.rate, faults=a.faults, seed=a.seed,
        fault_kinds=kinds, plan=kinds if a.plan else (), fault_window=a.fault_window, stop_s=a.stop_seconds,
        cancels=a.cancels if a.cancels is not None else a.requests // 50,
        lengths=tuple(int(x) for x in a.lengths.split(",")), max_tokens=a.max_tokens,
        deadlines={**DEADLINES, **a.deadlines}, router=a.router_config, slack_s=a.slack, tail=a.tail,
        settle_s=a.settle,
    )  # fmt: skip
    if not kvferry_connector_available():
        print("the kvferry connector is not in this checkout", file=sys.stderr)
        return 2
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="kvferry-soak-"))
    try:
        summary = run(cfg, ensure("llama"), workdir)
    except Exception as exc:
        print(f"soak could not run: {exc!r}"[:3000], file=sys.stderr)
        return 2
    summary["command"] = "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(summary)
    print("\n" + text + "\n" + json.dumps(summary, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(f"# Soak\n\nCommand: `{summary['command']}`\n\n{text}")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
