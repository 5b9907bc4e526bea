"""P/D comparison bench: in one run, start and sweep a single instance, upstream pull, upstream push and
kvferry push (when its connector exists), then print the P/D overhead TTFT(P/D) - TTFT(single) per mode
and the kvferry / upstream-push ratios, side by side.

Two baselines: `single` gets both cores (the same total CPU as a P/D pair); `single-1core` gets one
core, the resources of one P/D engine (as one GPU per engine in a GPU comparison). Against
`single-1core` the overhead is what disaggregation itself costs (legs, transfer, decode's first
step); against `single` it also includes prefill running on one core instead of two.

    python bench/pd_compare.py --out bench/results/pd_compare

Modes run one after another on the same machine (at most 2 vLLM servers alive at a time). Upstream
connectors run with the UCX progress thread off (kvferry.connector.plugins.upstream_patches), their best
configuration on a CPU host; pass --stock-upstream to run them as shipped.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import httpx
from kvferry.local.tinymodel import ensure
from kvferry.router.promtext import parse_metrics
from kvferry.tools import loadbench
from kvferry.tools.pdstack import PdStack, kvferry_connector_available
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

ALL_MODES = ("single", "single-1core", "vllm-pull", "vllm-push", "kvferry")
SINGLE_CORES = {"single": "0-1", "single-1core": "0"}
ROUTER_STATS: dict[str, dict[str, float]] = {}
RESTARTS: dict[str, list[str]] = {}  # mode -> cells after which its stack was started again


def measure(
    mode: str, sweep: loadbench.Sweep, model: Path, workdir: Path, stock: bool, kvferry_extra: dict
) -> list[loadbench.Cell]:
    """Start the mode's servers, sweep, stop them (by PID) even on failure.

    A P/D stack is started again after a cell with failed requests: upstream push can wedge silently
    and would then fail every later cell too, leaving nothing to compare (the failures stay counted).
    """
    print(f"== {mode}: starting", flush=True)
    if mode in SINGLE_CORES:
        spec = ServerSpec(model=model, port=free_port(), cores=SINGLE_CORES[mode])
        server = VllmProcess(spec, workdir / f"{mode}.log")
        with server:
            return loadbench.run_sweep(replace(sweep, url=server.url))
    cells: list[loadbench.Cell] = []
    stack: PdStack | None = None
    try:
        for length in sweep.lengths:
            for rate in sweep.rates:
                fresh = stack is None
                if fresh:
                    starts = len(RESTARTS.get(mode, [])) + 1
                    stack = PdStack(
                        mode,
                        model,
                        workdir / f"{mode}-{starts}",
                        no_progress_thread=not stock,
                        kvferry_extra=kvferry_extra,
                    )
                    stack.start()
                cell_sweep = replace(sweep, url=stack.url, lengths=(length,), rates=(rate,))
                cells += loadbench.run_sweep(cell_sweep, warmup=3 if fresh else 0)
                if cells[-1].failed:
                    failed = cells[-1].failed
                    print(f"== {mode}: {failed} failed at {length}x{rate:g}: restarting", flush=True)
                    RESTARTS.setdefault(mode, []).append(f"{length} tokens x {rate:g}/s")
                    _stop(mode, stack)
                    stack = None
        return cells
    finally:
        if stack is not None:
            _stop(mode, stack)


def _stop(mode: str, stack: PdStack) -> None:
    """Stop a stack, adding what its router had to do to the mode's totals."""
    try:
        totals = ROUTER_STATS.setdefault(mode, {})
        for k, v in router_stats(stack.url).items():
            totals[k] = totals.get(k, 0.0) + v
    finally:
        stack.stop()


def router_stats(url: str) -> dict[str, float]:
    """What the router had to do to get these numbers: recomputes and failed legs by reason."""
    metrics = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return {
        k: v
        for k, v in metrics.items()
        if k.startswith(("kvferry_router_recomputes_total", "kvferry_router_leg_errors_total")) and v
    }


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and not (math.isnan(a) or math.isnan(b)) else "n/a"


def _delta(a: float, b: float) -> str:
    """a - b in ms; n/a when a cell had no successful request (a wedged mode)."""
    return "n/a" if math.isnan(a) or math.isnan(b) else f"{a - b:+.1f}"


def comparison(results: dict[str, list[loadbench.Cell]]) -> str:
    """TTFT p50 per mode, overhead vs each single baseline, and kvferry / upstream-push ratios (TTFT,
    overhead, TPOT), one row per cell."""
    modes = [m for m in ALL_MODES if m in results]
    pd_modes = [m for m in modes if m not in SINGLE_CORES]
    bases = [b for b in SINGLE_CORES if b in results]
    ratio = "kvferry" in results and "vllm-push" in results
    head = ["prompt", "rate"] + [f"TTFT p50 {m}" for m in modes]
    for b in bases:
        head += [f"overhead vs {b} {m}" for m in pd_modes]
        head += [f"overhead vs {b} kvferry/push"] if ratio else []
    head += ["TTFT kvferry/push", "TPOT kvferry/push"] if ratio else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ttft = lambda m, i: results[m][i].ttft_ms["p50"]  # noqa: E731
    for i, cell in enumerate(results[modes[0]]):
        row = [str(cell.length), f"{cell.rate:g}"] + [f"{ttft(m, i):.1f}" for m in modes]
        for b in bases:
            row += [_delta(ttft(m, i), ttft(b, i)) for m in pd_modes]
            if ratio:
                row.append(_ratio(ttft("kvferry", i) - ttft(b, i), ttft("vllm-push", i) - ttft(b, i)))
        if ratio:
            k, p = results["kvferry"][i], results["vllm-push"][i]
            row += [_ratio(k.ttft_ms["p50"], p.ttft_ms["p50"]), _ratio(k.tpot_ms["p50"], p.tpot_ms["p50"])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(ALL_MODES))
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--rates", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per cell")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="per-request bound (a wedge shows as failures)"
    )
    parser.add_argument("--stock-upstream", action="store_true", help="keep upstream's UCX progress thread")
    parser.add_argument(
        "--kvferry-extra", type=json.loads, default={}, help="kv_connector_extra_config overrides (JSON)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/pd_compare"))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(ALL_MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(ALL_MODES)}")
    if "kvferry" in modes and not kvferry_connector_available():
        print("kvferry connector not in this checkout yet: skipping the kvferry mode", file=sys.stderr)
        modes.remove("kvferry")
    sweep = loadbench.Sweep(
        url="", lengths=tuple(int(x) for x in args.lengths.split(",")),
        rates=tuple(float(x) for x in args.rates.split(",")), max_tokens=args.max_tokens,
        duration_s=args.duration, timeout_s=args.timeout,
    )  # fmt: skip
    model = ensure("llama")
    results: dict[str, list[loadbench.Cell]] = {}
    with tempfile.TemporaryDirectory(prefix="pd-compare-") as tmp:
        for mode in modes:
            try:
                results[mode] = measure(
                    mode, sweep, model, Path(tmp), args.stock_upstream, args.kvferry_extra
                )
            except Exception as exc:  # one broken mode must not lose the others' numbers
                print(f"== {mode}: FAILED: {exc!r}"[:2000], file=sys.stderr)
                ROUTER_STATS[mode] = {"failed to run": 1.0}
    if not results:
        return 1
    tables = "\n".join(loadbench.markdown(results[m], m) for m in results)
    summary = comparison(results)
    stats = "\n".join(
        f"- {m}: {ROUTER_STATS.get(m) or 'no recomputes, no failed legs'}"
        for m in modes
        if m not in SINGLE_CORES
    )
    summary += "\nRouter recoveries during the sweep (kvferry_router_* counters):\n\n" + stats + "\n"
    if RESTARTS:
        restarts = "\n".join(f"- {m}: after {', '.join(cells)}" for m, cells in RESTARTS.items())
        summary += "\nStacks started again after a cell with failed requests:\n\n" + restarts + "\n"
    print("\n" + tables + "\n### P/D overhead and ratios (TTFT in ms)\n\n" + summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    upstream = "as shipped" if args.stock_upstream else "UCX progress thread off"
    header = f"# P/D comparison\n\nCommand: `python bench/pd_compare.py {' '.join(argv or sys.argv[1:])}`\n"
    header += f"Upstream connectors: {upstream}. Output tokens: {args.max_tokens}. Prefix caching off.\n\n"
    args.out.with_suffix(".md").write_text(header + summary + "\n" + tables)
    doc = {
        "sweep": asdict(sweep),
        "router": ROUTER_STATS,
        "restarts": RESTARTS,
        "modes": {m: [asdict(c) for c in cells] for m, cells in results.items()},
    }
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    loadbench.plot(
        results, args.out.with_suffix(".png"), "TTFT / TPOT p50: single vs P/D modes (2 CPU cores)"
    )
    print(f"wrote {args.out.with_suffix('.md')}, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
