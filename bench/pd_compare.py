"""P/D comparison bench: in one run, start and sweep a single instance, upstream pull, upstream push and
kvferry push (when its connector exists), then print the P/D overhead TTFT(P/D) - TTFT(single) per mode
and the kvferry / upstream-push ratios, side by side. Every cell is measured by two clients: the
project's own (`kvferry bench`, tools/loadbench.py) and vLLM's (`vllm bench serve`, tools/vllmbench.py,
a real client nobody here wrote); for each client a table gives kvferry's TTFT p50/p99, TPOT p50 and
throughput against the best upstream P/D mode of that cell, as ratios.

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
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from kvferry.contracts.promtext import parse_metrics
from kvferry.local.tinymodel import ensure
from kvferry.tools import loadbench, vllmbench
from kvferry.tools.pdstack import LOAD_ON, PdStack, add_placement_arguments, kvferry_connector_available
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

ALL_MODES = (
    "single",
    "single-1core",
    "vllm-pull",
    "vllm-push",
    "kvferry",
    "kvferry-bounded",
    "kvferry-at-once",
    "kvferry-early",
)
DEFAULT_MODES = ALL_MODES[:5]
OURS = ("kvferry", "kvferry-bounded", "kvferry-at-once", "kvferry-early")
# kvferry with router settings (main fills them from the command line):
# - bounded: the router's prefill queue bound (limits.max_prefill_wait_s, --max-wait): past saturation
#   it sheds with 429 what it could not start in time. Its 429s are not failures.
# - at-once: push.decode_start with-prefill, decode's leg sent with prefill's (kvferry's default before
#   2026-12-02; its default now opens decode's leg when prefill is about to start the request).
# - early: streaming.first_token prefill: a greedy stream's first token is prefill's, sent at once.
VARIANTS: dict[str, dict[str, Any]] = {}
UPSTREAM = ("vllm-pull", "vllm-push")
CLIENTS = ("kvferry", "vllm")  # tools/loadbench.py, `vllm bench serve`
SINGLE_CORES = {"single": "0-1", "single-1core": "0"}
ROUTER_STATS: dict[str, dict[str, float]] = {}
RESTARTS: dict[str, list[str]] = {}  # mode -> cells after which its stack was started again


Cells = dict[str, list]  # client -> cells (loadbench.Cell or vllmbench.BenchCell), in sweep order


def run_clients(sweep: loadbench.Sweep, url: str, clients: list[str], model: Path, warmup: int) -> Cells:
    """One cell (sweep has one length and rate) by each client, one after the other."""
    out: Cells = {}
    if "kvferry" in clients:
        out["kvferry"] = loadbench.run_sweep(replace(sweep, url=url), warmup=warmup)
    if "vllm" in clients:
        (length,), (rate,) = sweep.lengths, sweep.rates
        requests = max(sweep.min_requests, math.ceil(rate * sweep.duration_s))
        try:
            cell = vllmbench.run_cell(url, model, length, rate, requests, sweep.max_tokens, 900)
        except Exception as exc:  # keep the other client's numbers; show the cell as failed
            print(f"   vllm bench serve: {exc}"[:1000], file=sys.stderr)
            cell = vllmbench.BenchCell(length, rate, 0, requests)
        print(f"   vllm bench serve {length}x{rate:g}: TTFT p50={cell.ttft_ms.get('p50', math.nan):.1f}ms "
              f"TPOT p50={cell.tpot_ms.get('p50', math.nan):.2f}ms {cell.req_per_s:.2f} req/s")  # fmt: skip
        for error in dict.fromkeys(cell.errors):  # a failure is never left unexplained
            print(f"   vllm bench serve, failed request: {error}"[:1000], file=sys.stderr)
        out["vllm"] = [cell]
    return out


def _extend(into: Cells, more: Cells) -> None:
    for client, cells in more.items():
        into.setdefault(client, []).extend(cells)


def _failed(cells: Cells) -> int:
    return sum(c[-1].failed for c in cells.values() if c)


def measure(
    mode: str,
    sweep: loadbench.Sweep,
    model: Path,
    workdir: Path,
    stock: bool,
    kvferry_extra: dict,
    clients: list[str],
    whole: bool = True,
    load_cores: str = "",
) -> Cells:
    """Start the mode's servers, sweep (each cell by every client), stop them (by PID) even on failure.

    A P/D stack is started again after a cell with failed requests: upstream push can wedge silently
    and would then fail every later cell too, leaving nothing to compare (the failures stay counted).
    """
    print(f"== {mode}: starting", flush=True)
    cells: Cells = {}
    if mode in SINGLE_CORES:
        spec = ServerSpec(model=model, port=free_port(), cores=SINGLE_CORES[mode])
        server = VllmProcess(spec, workdir / f"{mode}.log")
        with server:
            if whole:  # the API server and engine core on the same cores as the worker
                server.pin(whole=True)
            for i, (length, rate) in enumerate((n, r) for n in sweep.lengths for r in sweep.rates):
                one = replace(sweep, lengths=(length,), rates=(rate,))
                _extend(cells, run_clients(one, server.url, clients, model, 3 if i == 0 else 0))
        return cells
    stack: PdStack | None = None
    try:
        for length in sweep.lengths:
            for rate in sweep.rates:
                fresh = stack is None
                if fresh:
                    starts = len(RESTARTS.get(mode, [])) + 1
                    stack = PdStack(
                        mode.partition("-")[0] if mode in OURS else mode,
                        model,
                        workdir / f"{mode}-{starts}",
                        no_progress_thread=not stock,
                        kvferry_extra=kvferry_extra,
                        router_extra=VARIANTS.get(mode, {}),
                        pin_whole=whole,
                        load_cores=load_cores,
                    )
                    stack.start()
                cell_sweep = replace(sweep, lengths=(length,), rates=(rate,))
                shed = _shed(stack.url)
                with stack.client_here():
                    more = run_clients(cell_sweep, stack.url, clients, model, 3 if fresh else 0)
                _extend(cells, more)
                if _failed(cells) > _shed(stack.url) - shed:  # failures beyond the router's 429s
                    failed = _failed(cells)
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
    """What the router had to do to get these numbers: recomputes and failed legs by reason, the
    requests it shed (429), and the streams whose first token came from prefill (`kvferry-early`)."""
    metrics = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return {
        k: v
        for k, v in metrics.items()
        if (k.startswith(("kvferry_router_recomputes_total", "kvferry_router_leg_errors_total")) and v)
        or (k.startswith("kvferry_router_first_token_from_prefill_total") and v)
        or (k.startswith("kvferry_router_requests_total") and 'outcome="overloaded"' in k and v)
    }


def _shed(url: str) -> float:
    return sum(v for k, v in router_stats(url).items() if k.startswith("kvferry_router_requests_total"))


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
    # A cell where a mode failed requests measured only its survivors: its TTFT reads n/a.
    ttft = lambda m, i: results[m][i].ttft_ms["p50"] if _served_all(results[m][i]) else math.nan  # noqa: E731
    for i, cell in enumerate(results[modes[0]]):
        row = [str(cell.length), f"{cell.rate:g}"] + [f"{ttft(m, i):.1f}" for m in modes]
        for b in bases:
            row += [_delta(ttft(m, i), ttft(b, i)) for m in pd_modes]
            if ratio:
                row.append(_ratio(ttft("kvferry", i) - ttft(b, i), ttft("vllm-push", i) - ttft(b, i)))
        if ratio:
            k, p = results["kvferry"][i], results["vllm-push"][i]
            tpot = p.tpot_ms["p50"] if _served_all(p) else math.nan
            row += [_ratio(ttft("kvferry", i), ttft("vllm-push", i)), _ratio(k.tpot_ms["p50"], tpot)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _best(cells: dict[str, Any], get: Callable[[Any], float], low: bool) -> tuple[float, str]:
    """The best value among the upstream modes' cells that served every request, and which mode had it
    (NaN when none did): a mode that failed requests in a cell measured only its survivors."""
    values = [(get(c), m) for m, c in cells.items() if _served_all(c) and not math.isnan(get(c))]
    if not values:
        return math.nan, "none served every request"
    return min(values) if low else max(values)


def _served_all(cell: Any) -> bool:
    return cell.ok > 0 and cell.failed == 0


def versus_best(results: dict[str, list], client: str, ours: str = "kvferry") -> str:
    """`ours` against the best upstream P/D mode of each cell: lowest TTFT p50/p99 and TPOT p50,
    highest throughput; ratios < 1 (latency) or > 1 (throughput) mean kvferry is better."""
    ups = [m for m in UPSTREAM if m in results]
    if ours not in results or not ups:
        return ""
    metrics = (
        ("TTFT p50", lambda c: c.ttft_ms.get("p50", math.nan), True),
        ("TTFT p99", lambda c: c.ttft_ms.get("p99", math.nan), True),
        ("TPOT p50", lambda c: c.tpot_ms.get("p50", math.nan), True),
        ("req/s", lambda c: c.req_per_s if c.ok else math.nan, False),
    )
    head = ["prompt", "rate"] + [f"{name} kvferry / best upstream" for name, _, _ in metrics]
    head.append("upstream left out (failed requests)")
    title = f"#### Client: {client}" + ("" if ours == "kvferry" else f", {ours}")
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, k in enumerate(results[ours]):
        row = [str(k.length), f"{k.rate:g}"]
        cells = {m: results[m][i] for m in ups}
        for _, get, low in metrics:
            best, mode = _best(cells, get, low)
            ok = "" if _served_all(k) else f" ({ours} failed {k.failed})"
            row.append(f"{get(k):.1f} / {best:.1f} ({mode}) = {_ratio(get(k), best)}{ok}")
        out = [f"{m} {c.failed}/{c.ok + c.failed}" for m, c in cells.items() if not _served_all(c)]
        row.append(", ".join(out) or "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def cells_table(cells: list, title: str) -> str:
    """Per-cell numbers of either client."""
    head = "| prompt | rate | ok/failed | TTFT p50 / p99 ms | TPOT p50 / p99 ms | req/s |"
    lines = [f"#### {title}", "", head, "|---|---|---|---|---|---|"]
    for c in cells:
        ttft = f"{c.ttft_ms.get('p50', math.nan):.1f} / {c.ttft_ms.get('p99', math.nan):.1f}"
        tpot = f"{c.tpot_ms.get('p50', math.nan):.2f} / {c.tpot_ms.get('p99', math.nan):.2f}"
        lines.append(f"| {c.length} | {c.rate:g} | {c.ok}/{c.failed} | {ttft} | {tpot} | {c.req_per_s:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"from {', '.join(ALL_MODES)}")
    parser.add_argument(
        "--max-wait", type=float, default=1.0, help="kvferry-bounded: the router's limits.max_prefill_wait_s"
    )
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--rates", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per cell")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="per-request bound (a wedge shows as failures)"
    )
    add_placement_arguments(parser)
    parser.add_argument("--stock-upstream", action="store_true", help="keep upstream's UCX progress thread")
    parser.add_argument(
        "--kvferry-extra", type=json.loads, default={}, help="kv_connector_extra_config overrides (JSON)"
    )
    parser.add_argument(
        "--clients", default=",".join(CLIENTS), help="kvferry (tools/loadbench.py), vllm (`vllm bench serve`)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/pd_compare"))
    args = parser.parse_args(argv)
    clients = [c for c in args.clients.split(",") if c]
    if not clients or set(clients) - set(CLIENTS):
        parser.error(f"--clients: a subset of {list(CLIENTS)}")
    modes = [m for m in args.modes.split(",") if m]
    VARIANTS["kvferry-bounded"] = {"limits": {"max_prefill_wait_s": args.max_wait}}
    VARIANTS["kvferry-early"] = {"streaming": {"first_token": "prefill"}}
    VARIANTS["kvferry-at-once"] = {"push": {"decode_start": "with-prefill"}}
    unknown = sorted(set(modes) - set(ALL_MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {list(ALL_MODES)}")
    if not kvferry_connector_available():
        print("kvferry connector not in this checkout yet: skipping the kvferry modes", file=sys.stderr)
        modes = [m for m in modes if m not in OURS]
    sweep = loadbench.Sweep(
        url="", lengths=tuple(int(x) for x in args.lengths.split(",")),
        rates=tuple(float(x) for x in args.rates.split(",")), max_tokens=args.max_tokens,
        duration_s=args.duration, timeout_s=args.timeout,
    )  # fmt: skip
    model = ensure("llama")
    by_client: dict[str, dict[str, list]] = {c: {} for c in clients}  # client -> mode -> cells
    with tempfile.TemporaryDirectory(prefix="pd-compare-") as tmp:
        for mode in modes:
            try:
                cells = measure(
                    mode,
                    sweep,
                    model,
                    Path(tmp),
                    args.stock_upstream,
                    args.kvferry_extra,
                    clients,
                    whole=args.pin == "whole",
                    load_cores=LOAD_ON[args.load_on],
                )
            except Exception as exc:  # one broken mode must not lose the others' numbers
                print(f"== {mode}: FAILED: {exc!r}"[:2000], file=sys.stderr)
                ROUTER_STATS[mode] = {"failed to run": 1.0}
                continue
            for client, client_cells in cells.items():
                by_client[client][mode] = client_cells
    if not any(by_client.values()):
        return 1
    tables = "\n".join(
        cells_table(cells, f"{m}, client {client}")
        for client, res in by_client.items()
        for m, cells in res.items()
    )
    results = by_client.get("kvferry", {})
    summary = comparison(results) if results else ""
    summary += "\n### kvferry against the best upstream mode, per client\n\n"
    summary += "\n".join(versus_best(res, client, o) for o in OURS for client, res in by_client.items())
    stats = "\n".join(
        f"- {m}: {ROUTER_STATS.get(m) or 'no recomputes, no failed legs'}"
        for m in modes
        if m not in SINGLE_CORES
    )
    summary += "\nRouter counters during the sweep (recoveries, shed, early first tokens):\n\n" + stats + "\n"
    if RESTARTS:
        restarts = "\n".join(f"- {m}: after {', '.join(cells)}" for m, cells in RESTARTS.items())
        summary += "\nStacks started again after a cell with failed requests:\n\n" + restarts + "\n"
    print("\n" + tables + "\n### P/D overhead and ratios (TTFT in ms)\n\n" + summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    upstream = "as shipped" if args.stock_upstream else "UCX progress thread off"
    header = f"# P/D comparison\n\nCommand: `python bench/pd_compare.py {' '.join(argv or sys.argv[1:])}`\n"
    header += f"Upstream connectors: {upstream}. Output tokens: {args.max_tokens}. Random prompts (no "
    header += "prefix-cache hits). Clients: " + ", ".join(clients) + ".\n\n"
    args.out.with_suffix(".md").write_text(header + summary + "\n" + tables)
    doc = {
        "sweep": asdict(sweep),
        "router": ROUTER_STATS,
        "restarts": RESTARTS,
        "clients": {
            client: {m: [asdict(c) for c in cells] for m, cells in res.items()}
            for client, res in by_client.items()
        },
    }
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    if results:
        loadbench.plot(
            results, args.out.with_suffix(".png"), "TTFT / TPOT p50: single vs P/D modes (2 CPU cores)"
        )
    print(f"wrote {args.out.with_suffix('.md')}, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
