"""Prefix bench: a multi-turn chat workload with a shared system prompt, run side by side in one run on a
single instance, upstream pull (NixlConnector) and kvferry with prefix awareness off and on; prints TTFT
and TPOT p50/p99, prompt tokens each engine actually computed and KV bytes moved between engines.

    flock /tmp/kvferry-heavy.lock python bench/prefix_bench.py --out bench/results/prefix_bench

Workload (seeded, `conversations()`): every conversation opens with the same system prompt; each turn
appends the previous turn's answer and a new user message (log-normal length) to the history, as chat
clients and agents re-send it. The answer is re-sent as the token ids the engine returned
(`return_token_ids`), so a decode that generated it may hold it in its prefix cache; answers are greedy
and equal in every mode (P/D outputs equal a single instance's: tests/e2e), so every mode sees the same
prompts. Conversations start as a Poisson process
at `rate` per second; a conversation's next turn is sent when its previous answer ended plus a short
think time. Prompts are token ids (the router's block keys are then exact).

Modes: `single` (one vLLM on both cores, prefix caching), `vllm-pull` (upstream NixlConnector, prefix
caching on both roles), `kvferry-off` (prefix caching on both roles; router: no prefix index, every
request through P and D), `kvferry-routed` (router: prefix index of what it routed, selective
disaggregation), `kvferry-on` (the same, the index also following the engines' KV-cache events, as the
operator deploys it: router/kvfeed.py). All engines
run with prefix caching and the same block size. Computed prompt tokens are vLLM's
`vllm:prompt_tokens_by_source_total{source="local_compute"}`; bytes are `kvferry_transfer_bytes_total`
(producer) and `vllm:nixl_bytes_transferred_sum` (upstream), deltas over the measured requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.local.tinymodel import ensure
from kvferry.tools import loadbench
from kvferry.tools.pdstack import PdStack
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

MODES = ("single", "vllm-pull", "kvferry-off", "kvferry-routed", "kvferry-on")
BLOCK = 64  # tokens per KV block on every engine (a multiple of 32 for vLLM-CPU)
COMPUTED = ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"})
PROMPT = ("vllm:prompt_tokens_total", {})
BYTES = (("kvferry_transfer_bytes_total", {}), ("vllm:nixl_bytes_transferred_sum", {}))


@dataclass(frozen=True)
class Turn:
    conversation: int
    index: int
    message: tuple[int, ...]  # appended after the previous answer (turn 0: the system prompt and a message)


@dataclass(frozen=True)
class Workload:
    system_tokens: int = 384
    conversations: int = 8
    turns: tuple[int, int] = (3, 5)  # inclusive range per conversation
    user_median: int = 96  # user message tokens: log-normal around this median
    user_sigma: float = 0.6
    user_bounds: tuple[int, int] = (16, 320)
    reply_tokens: int = 32
    vocab: int = 2000
    seed: int = 0


def conversations(w: Workload) -> list[list[Turn]]:
    """Each conversation's turns in order; turn k's prompt is turn k-1's prompt, its answer, a new message."""
    rng = random.Random(w.seed)
    ids = lambda n: [rng.randrange(10, w.vocab) for _ in range(n)]  # noqa: E731
    system = ids(w.system_tokens)
    out = []
    for c in range(w.conversations):
        turns = []
        for t in range(rng.randint(*w.turns)):
            length = round(rng.lognormvariate(math.log(w.user_median), w.user_sigma))
            message = ids(min(max(length, w.user_bounds[0]), w.user_bounds[1]))
            turns.append(Turn(c, t, tuple((system if t == 0 else []) + message)))
        out.append(turns)
    return out


async def run_workload(url: str, convs: list[list[Turn]], rate: float, reply: int, seed: int) -> list[Any]:
    """Start conversations Poisson at `rate`/s; each sends its turns one after another."""
    rng = random.Random(f"{seed}-{rate}")
    starts = loadbench.arrivals(rate, len(convs), rng)
    sweep = loadbench.Sweep(url=url, max_tokens=reply, timeout_s=120.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with sweep.client(limits=limits) as client:
        t0 = time.perf_counter()

        async def conversation(at: float, turns: list[Turn]) -> list[Any]:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            results, history = [], []
            for turn in turns:
                history += turn.message
                result = await loadbench.one_request(client, sweep, list(history), return_ids=True)
                results.append(result)
                if not result.ok:
                    break  # the history is unknown past a failed turn: the conversation ends here
                history += result.token_ids  # the answer, as the client re-sends it
                await asyncio.sleep(rng.expovariate(5.0))  # think time, mean 0.2 s
            return results

        per_conv = await asyncio.gather(*(conversation(at, ts) for at, ts in zip(starts, convs, strict=True)))
    return [r for rs in per_conv for r in rs]


@dataclass
class Row:
    mode: str
    rate: float
    ok: int
    failed: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    prompt_tokens: float  # sent to the engines (P and D count separately)
    computed: dict[str, float]  # role -> prompt tokens computed
    kv_bytes: float
    served: dict[str, float] = field(default_factory=dict)  # router: how requests were served
    errors: list[str] = field(default_factory=list)


def _engine_totals(servers: dict[str, Callable[[], dict[str, float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for role, read in servers.items():
        m = read()
        out[role] = {
            "computed": metric_sum(m, COMPUTED[0], **COMPUTED[1]),
            "prompt": metric_sum(m, PROMPT[0]),
            "bytes": sum(metric_sum(m, name) for name, _ in BYTES),
        }
    return out


def _router_served(url: str) -> dict[str, float]:
    m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    out = {}
    for key, value in m.items():
        if key.startswith("kvferry_router_served_total{"):
            labels = dict(kv.split("=", 1) for kv in key[len("kvferry_router_served_total{") : -1].split(","))
            out[f"{labels['path'].strip(chr(34))}/{labels['reason'].strip(chr(34))}"] = value
    return out


@contextmanager
def started(
    mode: str, model: Path, workdir: Path
) -> Iterator[tuple[str, dict[str, Callable[[], dict[str, float]]]]]:
    """The mode's servers, running: (client URL, role -> metrics reader); stopped by PID on exit."""
    if mode == "single":
        workdir.mkdir(parents=True, exist_ok=True)
        server = VllmProcess(
            ServerSpec(model, free_port(), cores="0-1", block_size=BLOCK), workdir / "single.log"
        )
        with server:
            yield server.url, {"single": server.metrics}
        return
    routing: dict[str, Any] = {
        "prefix_aware": False,
        "block_tokens": BLOCK,
        "disaggregation": {"rule": "always"},
    }
    if mode in ("kvferry-routed", "kvferry-on"):
        selective = {"rule": "selective", "min_prefill_tokens": 128, "decode_hit_fraction": 0.75}
        routing = {"prefix_aware": True, "block_tokens": BLOCK, "disaggregation": selective}
    stack = PdStack(
        "vllm-pull" if mode == "vllm-pull" else "kvferry", model, workdir / mode,
        prefill_block_size=BLOCK, decode_block_size=BLOCK, router_extra={"routing": routing},
        kv_events=mode == "kvferry-on",
    )  # fmt: skip
    stack.start()
    try:
        assert stack.prefill is not None and stack.decode is not None
        yield stack.url, {"prefill": stack.prefill.metrics, "decode": stack.decode.metrics}
    finally:
        stack.stop()


def measure(mode: str, rates: list[float], w: Workload, model: Path, workdir: Path) -> list[Row]:
    """Start the mode once and run the workload at each rate, each rate with its own seed (its own
    system prompt and users: nothing cached by an earlier rate helps a later one)."""
    print(f"== {mode}: starting", flush=True)
    t0 = time.monotonic()
    rows = []
    with started(mode, model, workdir / mode) as (url, servers):
        print(f"   started in {time.monotonic() - t0:.0f} s", flush=True)
        for i, rate in enumerate(rates):
            seeded = replace(w, seed=w.seed + i)
            rows.append(_measure_rate(mode, rate, seeded, url, servers))
    return rows


def _measure_rate(
    mode: str, rate: float, w: Workload, url: str, servers: dict[str, Callable[[], dict[str, float]]]
) -> Row:
    t0 = time.monotonic()
    before = _engine_totals(servers)
    served_before = {} if mode == "single" else _router_served(url)
    results = asyncio.run(run_workload(url, conversations(w), rate, w.reply_tokens, w.seed))
    after = _engine_totals(servers)
    served = {} if mode == "single" else _router_served(url)
    delta = {r: {k: after[r][k] - before[r][k] for k in after[r]} for r in after}
    cell = loadbench.summarize(0, rate, results, 1.0)
    row = Row(
        mode, rate, cell.ok, cell.failed, cell.ttft_ms, cell.tpot_ms,
        prompt_tokens=sum(d["prompt"] for d in delta.values()),
        computed={r: d["computed"] for r, d in delta.items()},
        kv_bytes=sum(d["bytes"] for d in delta.values()),
        served={k: v - served_before.get(k, 0.0) for k, v in served.items() if v - served_before.get(k, 0.0)},
        errors=cell.errors,
    )  # fmt: skip
    print(f"   {rate:g}/s in {time.monotonic() - t0:.0f} s: {row}", flush=True)
    return row


def table(rows: list[Row]) -> str:
    head = [
        "rate (conv/s)", "mode", "ok/failed", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)",
        "prompt tokens computed (P + D = total)", "KV bytes moved", "served (router)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = r.computed
        computed = (
            f"{c['single']:.0f}" if "single" in c
            else f"{c['prefill']:.0f} + {c['decode']:.0f} = {c['prefill'] + c['decode']:.0f}"
        )  # fmt: skip
        served = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(r.served.items())) or "-"
        cols = [
            f"{r.rate:g}", r.mode, f"{r.ok}/{r.failed}",
            f"{r.ttft_ms['p50']:.1f} / {r.ttft_ms['p99']:.1f}",
            f"{r.tpot_ms['p50']:.2f} / {r.tpot_ms['p99']:.2f}",
            computed, f"{r.kv_bytes / 2**20:.2f} MiB", served,
        ]  # fmt: skip
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def ratios(rows: list[Row]) -> str:
    """kvferry-on against each other P/D mode, per rate: TTFT p50, computed tokens, bytes."""
    out = []
    for rate in sorted({r.rate for r in rows}):
        by = {r.mode: r for r in rows if r.rate == rate}
        on = by.get("kvferry-on")
        if on is None:
            continue
        for other in ("vllm-pull", "kvferry-off", "kvferry-routed"):
            o = by.get(other)
            if o is None:
                continue
            if o.failed or on.failed:  # a mode that failed requests did less work: no ratio says anything
                out.append(f"- rate {rate:g}: kvferry-on / {other}: not compared ({other} failed {o.failed}, "
                           f"kvferry-on {on.failed} of their requests)")  # fmt: skip
                continue
            ratio = lambda a, b: f"{a / b:.2f}" if b else "n/a"  # noqa: E731
            out.append(
                f"- rate {rate:g}: kvferry-on / {other}: "
                f"TTFT p50 {ratio(on.ttft_ms['p50'], o.ttft_ms['p50'])}, "
                f"computed tokens {ratio(sum(on.computed.values()), sum(o.computed.values()))}, "
                f"KV bytes {ratio(on.kv_bytes, o.kv_bytes)}"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rates", default="0.5,1", help="conversation starts per second")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=384)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefix_bench"))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    w = Workload(
        system_tokens=args.system_tokens, conversations=args.conversations, reply_tokens=args.reply_tokens,
        seed=args.seed,
    )  # fmt: skip
    model = ensure("llama")
    rows: list[Row] = []
    rates = [float(x) for x in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as tmp:
        for mode in modes:
            try:
                rows += measure(mode, rates, w, model, Path(tmp))
            except Exception as exc:  # one broken mode must not lose the others' numbers
                print(f"== {mode}: FAILED: {exc!r}"[:2000], file=sys.stderr)
    rows.sort(key=lambda r: (r.rate, MODES.index(r.mode)))
    if not rows:
        return 1
    turns = sum(len(c) for c in conversations(w))  # per rate (seed + rate index)
    text = (
        f"Workload: {w.conversations} conversations, {turns} turns, system prompt {w.system_tokens} tokens, "
        f"replies {w.reply_tokens} tokens, block {BLOCK} tokens, seed {w.seed}.\n\n"
        + table(rows)
        + "\n"
        + ratios(rows)
    )
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    header = f"# Prefix bench\n\nCommand: `python bench/prefix_bench.py {' '.join(argv or sys.argv[1:])}`\n\n"
    args.out.with_suffix(".md").write_text(header + text)
    doc = {"workload": asdict(w), "rows": [asdict(r) for r in rows]}
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out.with_suffix('.md')}, .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
