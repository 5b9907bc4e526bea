"""Load bench step: sweep prompt lengths x request rates against any OpenAI-compatible endpoint and
report TTFT and TPOT p50/p99 per cell (markdown, JSON, PNG).

Arrivals are Poisson with a fixed seed; prompts are random token ids of exact lengths (no tokenizer
needed, no prefix sharing); every request streams with `ignore_eos` so output lengths are fixed.

    kvferry bench --url http://127.0.0.1:8000 --lengths 256,512,1024 --rates 1,2,4,8 --out bench/results/x
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kvferry.router.config import AuthConfig, ConfigError, read_api_key
from kvferry.tools.stats import percentile


@dataclass
class Sweep:
    url: str
    model: str = "tiny"
    lengths: tuple[int, ...] = (256, 512, 1024)
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    max_tokens: int = 32
    duration_s: float = 8.0  # per cell: requests = max(min_requests, rate * duration_s)
    min_requests: int = 12
    seed: int = 0
    timeout_s: float = 120.0
    vocab: int = 2000
    api_key: str | None = field(default=None, repr=False)  # sent as a Bearer token; never written out

    def client(self, **kw: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.AsyncClient(timeout=self.timeout_s, headers=headers, **kw)


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0
    tokens: int = 0
    error: str = ""
    token_ids: list[int] = field(default_factory=list)  # the answer's ids, when asked for


@dataclass
class Cell:
    length: int
    rate: float
    ok: int
    failed: int
    ttft_ms: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    e2e_p50_ms: float = 0.0
    req_per_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate, starting at 0."""
    t, times = 0.0, []
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def prompts(length: int, count: int, vocab: int, rng: random.Random) -> list[list[int]]:
    # Ids above the tokenizer's special tokens; random, so no two prompts share a prefix block.
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


async def one_request(
    client: httpx.AsyncClient, sweep: Sweep, prompt: list[int], return_ids: bool = False
) -> Result:
    """One streamed greedy completion; with `return_ids` the answer's token ids too (vLLM's
    `return_token_ids`), as a multi-turn client re-sends them in the next prompt."""
    body = {
        "model": sweep.model, "prompt": prompt, "max_tokens": sweep.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        **({"return_token_ids": True} if return_ids else {}),
    }  # fmt: skip
    start = time.perf_counter()
    first, tokens, ids = 0.0, 0, list[int]()
    try:
        async with client.stream("POST", sweep.url.rstrip("/") + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return Result(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(False, error=str(event["error"])[:200])
                if event.get("choices") and not first:
                    first = time.perf_counter() - start
                if return_ids and event.get("choices"):
                    ids += event["choices"][0].get("token_ids") or []
                if event.get("usage"):
                    tokens = int(event["usage"].get("completion_tokens", 0))
    except (httpx.HTTPError, ValueError) as exc:
        return Result(False, error=repr(exc)[:200])
    e2e = time.perf_counter() - start
    if not first or tokens < 1:
        return Result(False, error="stream ended without tokens or usage")
    tpot = (e2e - first) / (tokens - 1) if tokens > 1 else 0.0
    if return_ids and len(ids) != tokens:
        return Result(False, error=f"{len(ids)} token ids for {tokens} tokens")
    return Result(True, ttft_s=first, tpot_s=tpot, e2e_s=e2e, tokens=tokens, token_ids=ids)


async def run_cell(sweep: Sweep, length: int, rate: float) -> Cell:
    rng = random.Random(f"{sweep.seed}-{length}-{rate}")
    count = max(sweep.min_requests, int(rate * sweep.duration_s))
    times, batch = arrivals(rate, count, rng), prompts(length, count, sweep.vocab, rng)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with sweep.client(limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(at: float, prompt: list[int]) -> Result:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await one_request(client, sweep, prompt)

        results = await asyncio.gather(*(fire(at, p) for at, p in zip(times, batch, strict=True)))
        wall = time.perf_counter() - t0
    return summarize(length, rate, list(results), wall)


def summarize(length: int, rate: float, results: list[Result], wall_s: float) -> Cell:
    good = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1000 for r in good]
    tpot = [r.tpot_s * 1000 for r in good if r.tokens > 1]
    return Cell(
        length=length, rate=rate, ok=len(good), failed=len(results) - len(good),
        ttft_ms={"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        tpot_ms={"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
        e2e_p50_ms=percentile([r.e2e_s * 1000 for r in good], 50),
        req_per_s=len(good) / wall_s if wall_s > 0 else 0.0,
        errors=sorted({r.error for r in results if not r.ok})[:5],
    )  # fmt: skip


def run_sweep(sweep: Sweep, warmup: int = 3, log: Any = print) -> list[Cell]:
    """All cells, lengths outer and rates ascending; a few sequential warm-up requests first."""

    async def main() -> list[Cell]:
        async with sweep.client() as client:
            rng = random.Random(sweep.seed)
            for prompt in prompts(min(sweep.lengths), warmup, sweep.vocab, rng):
                await one_request(client, sweep, prompt)
        cells = []
        for length in sweep.lengths:
            for rate in sweep.rates:
                cell = await run_cell(sweep, length, rate)
                log(f"  len={length} rate={rate:g}: ok={cell.ok} failed={cell.failed} "
                    f"TTFT p50={cell.ttft_ms['p50']:.1f}ms TPOT p50={cell.tpot_ms['p50']:.2f}ms")  # fmt: skip
                cells.append(cell)
        return cells

    return asyncio.run(main())


def markdown(cells: list[Cell], title: str) -> str:
    head = "| prompt tokens | rate (req/s) | ok/failed | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
    lines = [f"### {title}", "", head + "| e2e p50 (ms) | achieved req/s |", "|---|---|---|---|---|---|---|"]
    for c in cells:
        ttft = f"{c.ttft_ms['p50']:.1f} / {c.ttft_ms['p99']:.1f}"
        tpot = f"{c.tpot_ms['p50']:.2f} / {c.tpot_ms['p99']:.2f}"
        cols = [str(c.length), f"{c.rate:g}", f"{c.ok}/{c.failed}", ttft, tpot, f"{c.e2e_p50_ms:.0f}"]
        lines.append("| " + " | ".join([*cols, f"{c.req_per_s:.2f}"]) + " |")
    return "\n".join(lines) + "\n"


def plot(series: dict[str, list[Cell]], path: Path, title: str) -> None:
    """TTFT p50 and TPOT p50 against rate: one line per (label, prompt length)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, cells in series.items():
        for length in sorted({c.length for c in cells}):
            row = [c for c in cells if c.length == length]
            name = f"{label} {length}t" if len(series) > 1 else f"{length} tokens"
            ax_ttft.plot([c.rate for c in row], [c.ttft_ms["p50"] for c in row], marker="o", label=name)
            ax_tpot.plot([c.rate for c in row], [c.tpot_ms["p50"] for c in row], marker="o", label=name)
    for ax, what in ((ax_ttft, "TTFT p50 (ms)"), (ax_tpot, "TPOT p50 (ms)")):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(what)
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    ax_tpot.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, label: str, sweep: Sweep, cells: list[Cell]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in asdict(sweep).items() if k != "api_key"}
    doc = {"label": label, "sweep": settings, "cells": [asdict(c) for c in cells]}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(cells, label))
    plot({label: cells}, out.with_suffix(".png"), label)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry bench", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="OpenAI-compatible base URL (router or vLLM)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lengths", default="256,512,1024", help="prompt lengths in tokens")
    parser.add_argument("--rates", default="1,2,4,8", help="request rates (req/s)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="bench")
    parser.add_argument("--out", type=Path, help="write OUT.json, OUT.md and OUT.png")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key-env", metavar="VAR", help="send the API key in this environment variable")
    key.add_argument("--api-key-file", help="send the API key in this file (e.g. a mounted Secret)")
    args = parser.parse_args(argv)
    try:
        api_key = read_api_key(AuthConfig(api_key_env=args.api_key_env, api_key_file=args.api_key_file))
    except ConfigError as exc:
        parser.error(str(exc).replace("auth.api_key_", "--api-key-"))
    sweep = Sweep(
        url=args.url, model=args.model, lengths=tuple(int(x) for x in _floats(args.lengths)),
        rates=_floats(args.rates), max_tokens=args.max_tokens, duration_s=args.duration, seed=args.seed,
        api_key=api_key,
    )  # fmt: skip
    if not sweep.lengths or not sweep.rates or min(sweep.rates) <= 0:
        parser.error("--lengths and --rates need at least one positive value each")
    cells = run_sweep(sweep)
    print(markdown(cells, args.label))
    if args.out:
        write_outputs(args.out, args.label, sweep, cells)
        print(f"wrote {args.out.with_suffix('.md')}, .json and .png")
    return 0 if all(c.failed == 0 for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
