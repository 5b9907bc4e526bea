"""Load for bench/autoscale_bench.py: an open-loop stream of streamed completions at a rate that follows a
schedule, each request timed by the client (TTFT, mean inter-token latency), and the per-bucket summary.

Open loop: requests are sent at the scheduled rate whether or not earlier ones finished, as users
arrive; a saturated role therefore shows as a growing TTFT, not as a slower client. Prompts are token
ids drawn per request (no two share a prefix block), so every prompt is computed and its KV moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from kvferry.tools.stats import percentile_or_none as pct

VOCAB = (10, 900)  # token ids inside the tiny model's vocabulary
REQUEST_TIMEOUT_S = 180.0


@dataclass
class Sample:
    sent: float  # seconds since the load started
    ttft: float | None  # client-side: send to first streamed token
    itl: float | None  # mean gap between the following tokens
    tokens: int
    error: str = ""


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    output_tokens: int


class OpenLoop:
    """Sends requests at `rate(t)` per second (t: seconds since start) until `stop()`."""

    def __init__(self, url: str, model: str, shape: Callable[[float], Shape], rate: Callable[[float], float],
                 seed: int = 1) -> None:  # fmt: skip
        self.url, self.model, self.shape, self.rate = url, model, shape, rate
        self.samples: list[Sample] = []
        self.in_flight = 0
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self.t0 = time.monotonic()  # the schedule's zero: now, so callers may read now() at once

    def stop(self) -> None:
        self._stop.set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            while not self._stop.is_set():
                t = self.now()
                task = asyncio.create_task(self._one(session, t, self.shape(t)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                rate = max(self.rate(t), 0.05)
                with contextlib.suppress(asyncio.TimeoutError):  # Poisson arrivals at the rate
                    await asyncio.wait_for(self._stop.wait(), self._rng.expovariate(rate))
            if tasks:
                await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 10)

    async def _one(self, session: aiohttp.ClientSession, sent: float, shape: Shape) -> None:
        prompt = [self._rng.randrange(*VOCAB) for _ in range(shape.prompt_tokens)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": shape.output_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        t_start, stamps, error, tokens = time.monotonic(), [], "", 0
        self.in_flight += 1
        try:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with session.post(self.url + "/v1/completions", json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    error = f"HTTP {resp.status}: {(await resp.text())[:120]}"
                else:
                    async for line in resp.content:
                        if line.startswith(b'data: {"error'):
                            error = line[:160].decode(errors="replace")
                        elif b'"completion_tokens"' in line:  # the usage chunk, last
                            tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                        elif line.startswith(b"data: {"):  # one event may carry several tokens
                            stamps.append(time.monotonic())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error = repr(exc)[:160]
        finally:
            self.in_flight -= 1
        if not error and tokens < shape.output_tokens:
            error = f"stream ended after {tokens} of {shape.output_tokens} tokens"
        ttft = stamps[0] - t_start if stamps else None
        itl = (stamps[-1] - stamps[0]) / (tokens - 1) if len(stamps) > 1 and tokens > 1 else None
        self.samples.append(Sample(sent, ttft, itl, tokens, error))


def buckets(samples: list[Sample], width_s: float, end_s: float) -> list[dict[str, float | int | None]]:
    """Per `width_s` of send time: requests, failures, TTFT p50/p90 and ITL p50 (seconds)."""
    out = []
    for i in range(int(end_s // width_s) + 1):
        lo, hi = i * width_s, (i + 1) * width_s
        group = [s for s in samples if lo <= s.sent < hi]
        ok = [s for s in group if not s.error]
        ttfts = [s.ttft for s in ok if s.ttft is not None]
        itls = [s.itl for s in ok if s.itl is not None]
        out.append({
            "t": lo, "n": len(group), "failed": len(group) - len(ok),
            "ttft_p50": pct(ttfts, 50), "ttft_p90": pct(ttfts, 90), "itl_p50": pct(itls, 50),
        })  # fmt: skip
    return out
