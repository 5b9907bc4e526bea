"""Decode's TPOT at one rate, upstream pull against kvferry (as shipped and with connector overrides),
stacks alternated in rounds so that host drift hits every variant alike. vLLM's own client
(`vllm bench serve`) measures; decode's endpoint wake-ups and CPU per request come from its metrics.

    python bench/decode_tpot_ab.py --rate 4 --requests 80 --rounds 2 \
        --variant 'kvferry-poll1ms={"poll_min_s": 0.001}' --out bench/results/decode_tpot_ab

Answers whether a TPOT gap in a short cell of bench/pd_compare.py is cost or noise, and whether the
consumer's polling is part of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from kvferry.local.tinymodel import ensure
from kvferry.router.promtext import metric_sum, parse_metrics
from kvferry.tools import vllmbench
from kvferry.tools.pdstack import PdStack

LENGTH, MAX_TOKENS = 1024, 32


def decode_metrics(stack: PdStack) -> dict[str, float]:
    assert stack.decode is not None
    return parse_metrics(httpx.get(stack.decode.url + "/metrics", timeout=10).text)


def one(model: Path, mode: str, extra: dict[str, Any], rate: float, requests: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"tpot-ab-{mode}-") as tmp:
        stack = PdStack(mode, model, Path(tmp), kvferry_extra=extra).start()
        try:
            vllmbench.run_cell(stack.url, model, LENGTH, rate, 16, MAX_TOKENS, 900)  # warm-up
            before = decode_metrics(stack)
            cell = vllmbench.run_cell(stack.url, model, LENGTH, rate, requests, MAX_TOKENS, 900)
            after = decode_metrics(stack)
        finally:
            stack.stop()
    grew = lambda name: (metric_sum(after, name) - metric_sum(before, name)) / requests  # noqa: E731
    return {
        "tpot_p50_ms": cell.tpot_ms["p50"], "ttft_p50_ms": cell.ttft_ms["p50"], "failed": cell.failed,
        "d_rounds_per_request": grew("kvferry_endpoint_rounds_total"),
        "d_endpoint_cpu_ms_per_request": 1000 * grew("kvferry_endpoint_cpu_seconds_total"),
    }  # fmt: skip


def report(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Decode TPOT A/B", "", f"Command: `{command}`", "",
        "| round | variant | TPOT p50 ms | / pull | TTFT p50 ms | failed | D wake-ups / request "
        "| D endpoint CPU ms / request |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    pull = {r["round"]: r["tpot_p50_ms"] for r in rows if r["variant"] == "pull"}
    for r in rows:
        ratio = r["tpot_p50_ms"] / pull[r["round"]] if r["round"] in pull else float("nan")
        lines.append(
            f"| {r['round']} | {r['variant']} | {r['tpot_p50_ms']:.2f} | {ratio:.2f} "
            f"| {r['ttft_p50_ms']:.1f} | {r['failed']} | {r['d_rounds_per_request']:.1f} "
            f"| {r['d_endpoint_cpu_ms_per_request']:.2f} |"
        )
    by: dict[str, list[float]] = {}
    for r in rows:
        if r["round"] in pull:
            by.setdefault(r["variant"], []).append(r["tpot_p50_ms"] / pull[r["round"]])
    lines += ["", "Median TPOT ratio to pull over rounds: "]
    lines[-1] += ", ".join(f"{v} {statistics.median(x):.2f}" for v, x in by.items())
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--variant", action="append", default=[],
        help="NAME=JSON: kvferry with these kv_connector_extra_config overrides (repeatable)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants: list[tuple[str, str, dict[str, Any]]] = [("pull", "vllm-pull", {}), ("kvferry", "kvferry", {})]
    for spec in args.variant:
        name, _, extra = spec.partition("=")
        variants.append((name, "kvferry", json.loads(extra)))
    model = ensure("llama")
    rows = []
    for rnd in range(args.rounds):
        for name, mode, extra in variants:
            row = {"round": rnd, "variant": name, **one(model, mode, extra, args.rate, args.requests)}
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
