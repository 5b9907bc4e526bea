"""P/D at one rate, upstream pull against kvferry (as shipped and with overrides), stacks alternated in
rounds so that host drift hits every variant alike. vLLM's own client (`vllm bench serve`) measures
after a warm-up of its own; decode's endpoint wake-ups and CPU per request come from its metrics, the
requests the router shed (429) from the router's.

    python bench/pd_ab.py --rate 4 --requests 80 --rounds 2 \
        --variant 'kvferry-poll1ms={"connector": {"poll_min_s": 0.001}}' --out bench/results/decode_tpot_ab
    python bench/pd_ab.py --rate 16 --requests 160 --warmup 64 --rounds 2 \
        --variant 'kvferry-at-once={"router": {"push": {"decode_start": "with-prefill"}}}' \
        --out bench/results/pd_ab_16_variants

Answers whether a gap in a short cell of bench/pd_compare.py is cost or noise (a fresh stack's first
hundreds of requests at saturation are slower than the rest), and which override moves it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry.contracts.promtext import metric_sum
from kvferry.local.tinymodel import ensure
from kvferry.tools import vllmbench
from kvferry.tools.pdstack import LOAD_ON, PdStack, add_placement_arguments

LENGTH, MAX_TOKENS = 1024, 32


@dataclass(frozen=True)
class Variant:
    name: str
    mode: str  # a PdStack mode
    connector: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config overrides
    router: dict[str, Any] = field(default_factory=dict)  # router.yaml keys


def parse_variant(spec: str) -> Variant:
    """NAME=JSON, JSON an object with optional keys connector and router; raises ValueError naming what
    is wrong."""
    name, sep, text = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"--variant {spec!r}: expected NAME=JSON")
    doc = json.loads(text)
    unknown = set(doc) - {"connector", "router"} if isinstance(doc, dict) else {"(not an object)"}
    if unknown:
        raise ValueError(f"--variant {name}: unknown keys {sorted(unknown)}; use connector and router")
    return Variant(name, "kvferry", doc.get("connector", {}), doc.get("router", {}))


def _cpu() -> list[int]:
    """The host's CPU time counters (/proc/stat's cpu line: user nice system idle iowait irq softirq
    steal ...), in ticks."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def steal_fraction(before: list[int], after: list[int]) -> float:
    """Share of the host's CPU time the hypervisor gave to someone else between two readings: a cell
    measured while it was high measured the neighbours, not the stack."""
    spent = [b - a for a, b in zip(before, after, strict=True)]
    return spent[7] / sum(spent) if sum(spent) else 0.0


def _shed_by(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The 429s by the role and limits key that refused them (kvferry_router_shed_total's labels)."""
    name = "kvferry_router_shed_total{"
    grown = {k[len(name) : -1]: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(name)}
    return {k: v for k, v in grown.items() if v}


def one(
    model: Path, v: Variant, rate: float, requests: int, warmup: int, whole: bool, load_cores: str
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"pd-ab-{v.name}-") as tmp:
        stack = PdStack(
            v.mode, model, Path(tmp), kvferry_extra=v.connector, router_extra=v.router, pin_whole=whole,
            load_cores=load_cores,
        ).start()  # fmt: skip
        assert stack.prefill is not None and stack.decode is not None and stack.router is not None
        try:
            if warmup:  # 0: measure the fresh stack (its first requests at this rate)
                with stack.client_here():  # the client process inherits these cores
                    vllmbench.run_cell(stack.url, model, LENGTH, rate, warmup, MAX_TOKENS, 900)
            d0, r0, c0, m0 = stack.decode.metrics(), stack.router.metrics(), _cpu(), stack.prefill.metrics()
            p0, dt0 = stack.prefill.cpu_seconds(), stack.decode.cpu_seconds()
            with stack.client_here():
                cell = vllmbench.run_cell(stack.url, model, LENGTH, rate, requests, MAX_TOKENS, 900)
            p1, dt1 = stack.prefill.cpu_seconds(), stack.decode.cpu_seconds()
            d1, r1, c1, m1 = stack.decode.metrics(), stack.router.metrics(), _cpu(), stack.prefill.metrics()
        finally:
            stack.stop()
    grew = lambda a, b, name: metric_sum(b, name) - metric_sum(a, name)  # noqa: E731
    shed_by = _shed_by(r0, r1)
    return {
        "tpot_p50_ms": cell.tpot_ms["p50"], "ttft_p50_ms": cell.ttft_ms["p50"],
        "ttft_p99_ms": cell.ttft_ms["p99"], "req_per_s": cell.req_per_s, "failed": cell.failed,
        "shed": sum(shed_by.values()), "shed_by": shed_by, "steal": steal_fraction(c0, c1),
        "errors": list(cell.errors[:3]),
        "p_cpu_ms_per_request": 1000 * (p1 - p0) / requests,
        "p_rounds_per_request": grew(m0, m1, "kvferry_endpoint_rounds_total") / requests,
        "p_endpoint_cpu_ms_per_request": 1000 * grew(m0, m1, "kvferry_endpoint_cpu_seconds_total") / requests,
        "d_cpu_ms_per_request": 1000 * (dt1 - dt0) / requests,
        "d_rounds_per_request": grew(d0, d1, "kvferry_endpoint_rounds_total") / requests,
        "d_endpoint_cpu_ms_per_request": 1000 * grew(d0, d1, "kvferry_endpoint_cpu_seconds_total") / requests,
    }  # fmt: skip


COLUMNS = (  # (header, key, format, compared with pull)
    ("TTFT p50 ms", "ttft_p50_ms", ".1f", True),
    ("TTFT p99 ms", "ttft_p99_ms", ".1f", True),
    ("TPOT p50 ms", "tpot_p50_ms", ".2f", True),
    ("req/s", "req_per_s", ".2f", True),
    ("failed", "failed", "d", False),
    ("shed", "shed", ".0f", False),
    ("host steal", "steal", ".1%", False),
    ("P CPU ms / request", "p_cpu_ms_per_request", ".1f", True),  # the whole server: API, engine, worker
    ("P wake-ups / request", "p_rounds_per_request", ".1f", False),  # kvferry's endpoint thread
    ("P endpoint CPU ms / request", "p_endpoint_cpu_ms_per_request", ".2f", False),
    ("D CPU ms / request", "d_cpu_ms_per_request", ".1f", True),
    ("D wake-ups / request", "d_rounds_per_request", ".1f", False),
    ("D endpoint CPU ms / request", "d_endpoint_cpu_ms_per_request", ".2f", False),
)


def _ratio(row: dict[str, Any], pull: dict[str, Any] | None, key: str) -> float:
    return row[key] / pull[key] if pull and pull[key] else math.nan


def report(rows: list[dict[str, Any]], command: str) -> str:
    head = ["round", "variant"]
    for title, _, _, versus in COLUMNS:
        head += [title, "/ pull"] if versus else [title]
    lines = ["# P/D A/B at one rate", "", f"Command: `{command}`", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + "---|" * len(head))
    pull = {r["round"]: r for r in rows if r["variant"] == "pull"}
    for r in rows:
        cells = [str(r["round"]), r["variant"]]
        for _, key, fmt, versus in COLUMNS:
            cells.append(format(int(r[key]) if fmt == "d" else r[key], fmt))
            if versus:
                cells.append(f"{_ratio(r, pull.get(r['round']), key):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Ratio to pull over rounds, median (lowest-highest):", ""]
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "pull"):
        mine = [r for r in rows if r["variant"] == variant and r["round"] in pull]
        parts = []
        for title, key, _, versus in COLUMNS:
            ratios = [_ratio(r, pull[r["round"]], key) for r in mine]
            if versus and ratios:
                parts.append(f"{title} {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        lines.append(f"- {variant}: " + ", ".join(parts))
    lines += ["", "Spread of one variant over rounds (highest / lowest):", ""]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        parts = [
            f"{title} {max(r[key] for r in mine) / min(r[key] for r in mine):.2f}"
            for title, key, _, versus in COLUMNS
            if versus and min(r[key] for r in mine) > 0
        ]
        lines.append(f"- {variant}: " + ", ".join(parts))
    shed_by = [f"round {r['round']} {r['variant']}: {r['shed_by']}" for r in rows if r.get("shed_by")]
    if shed_by:
        lines += ["", "What refused the 429s (role, limits key):", ""] + [f"- {s}" for s in shed_by]
    errors = sorted({e for r in rows for e in r.get("errors", [])})
    if errors:
        lines += ["", "What vLLM's client said of failed requests:", ""] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=16, help="requests at the same rate before the cell")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--variant", action="append", default=[], type=parse_variant,
        help='NAME=JSON: kvferry with {"connector": {...}, "router": {...}} overrides (repeatable)',
    )  # fmt: skip
    add_placement_arguments(parser)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = [Variant("pull", "vllm-pull"), Variant("kvferry", "kvferry"), *args.variant]
    model = ensure("llama")
    rows = []
    whole, load = args.pin == "whole", LOAD_ON[args.load_on]
    for rnd in range(args.rounds):
        for v in variants:
            cell = one(model, v, args.rate, args.requests, args.warmup, whole, load)
            row = {"round": rnd, "variant": v.name, **cell}
            print(row, flush=True)
            rows.append(row)
    text = report(rows, "python " + " ".join(sys.argv))
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
