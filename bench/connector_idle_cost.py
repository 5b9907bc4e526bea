"""Decode's connector cost with nothing to transfer: does loading a KV connector slow decode down?

One engine on one core serves decode-only requests (no kv_transfer_params, so no transfer ever runs)
with no connector, with kvferry's connector in the decode role (as shipped, and `kvferry-poll`: its
endpoint polling every poll_max_s even with nothing pending, the behaviour before idle_tick_s), and with
upstream's NixlConnector in the decode role (UCX progress thread off, as in pd_compare.py). Modes
alternate in rounds (A B C D A B C D), one server alive at a time, so slow drifts of a shared machine
spread over all modes. Prints TTFT and TPOT p50 per mode with the ratio to no connector, and for
kvferry what its connector did meanwhile: endpoint wake-ups per second and CPU share, and the time of
its worker hooks per engine step.

    python bench/connector_idle_cost.py --rounds 2 --rate 2 --duration 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.local.tinymodel import ensure
from kvferry.tools import loadbench
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

MODES = ("none", "kvferry", "kvferry-poll", "nixl")
CONNECTOR = {"kvferry": "KvferryConnector", "kvferry-poll": "KvferryConnector", "nixl": "NixlConnector"}
EXTRA = {"kvferry": {"backends": ["UCX"]}, "kvferry-poll": {"backends": ["UCX"], "idle_tick_s": 0.01}}
USAGE = ("kvferry_endpoint_rounds_total", "kvferry_endpoint_cpu_seconds_total",
         "kvferry_step_hook_seconds_total", "kvferry_steps_total")  # fmt: skip


@dataclass
class Sample:
    mode: str
    ttft_ms: float
    tpot_ms: float
    ok: int
    failed: int
    seconds: float
    usage: dict[str, float] = field(default_factory=dict)  # kvferry: deltas of USAGE over the cell


def spec(mode: str, model: Path, core: str) -> ServerSpec:
    if mode == "none":
        return ServerSpec(model=model, port=free_port(), cores=core)
    return ServerSpec(
        model=model, port=free_port(), role="decode", connector=CONNECTOR[mode], engine_id="decode-0",
        side_port=free_port(), cores=core, no_progress_thread=mode == "nixl",
        connector_extra=EXTRA.get(mode, {}),
    )  # fmt: skip


def usage(url: str) -> dict[str, float]:
    metrics = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return {name: metric_sum(metrics, name) for name in USAGE}


def measure(mode: str, model: Path, sweep: loadbench.Sweep, core: str, workdir: Path) -> Sample:
    with VllmProcess(spec(mode, model, core), workdir / f"{mode}-{time.monotonic_ns()}.log") as server:
        cell_sweep = loadbench.Sweep(**{**sweep.__dict__, "url": server.url})
        loadbench.run_sweep(cell_sweep, warmup=3, log=lambda *_: None)  # warm: compile, caches
        before, t0 = usage(server.url), time.monotonic()
        (cell,) = loadbench.run_sweep(cell_sweep, warmup=0)
        seconds = time.monotonic() - t0
        time.sleep(1.5)  # the connector's usage counters are flushed once a second
        after = usage(server.url)
    delta = {k: after[k] - before[k] for k in USAGE} if mode in EXTRA else {}
    return Sample(mode, cell.ttft_ms["p50"], cell.tpot_ms["p50"], cell.ok, cell.failed, seconds, delta)


def table(samples: list[Sample]) -> str:
    by_mode = {m: [s for s in samples if s.mode == m] for m in MODES}
    base_tpot = statistics.median(s.tpot_ms for s in by_mode["none"])
    base_ttft = statistics.median(s.ttft_ms for s in by_mode["none"])
    lines = [
        "| mode | rounds | TTFT p50 ms | TPOT p50 ms | TTFT / none | TPOT / none | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, runs in by_mode.items():
        if not runs:
            continue
        ttft = statistics.median(s.ttft_ms for s in runs)
        tpot = statistics.median(s.tpot_ms for s in runs)
        per_round = ", ".join(f"{s.tpot_ms:.2f}" for s in runs)
        lines.append(
            f"| {mode} | {len(runs)} | {ttft:.1f} | {tpot:.2f} ({per_round}) | {ttft / base_ttft:.3f} | "
            f"{tpot / base_tpot:.3f} | {sum(s.failed for s in runs)} |"
        )
    for s in by_mode["kvferry"] + by_mode["kvferry-poll"]:
        u = s.usage
        steps = u["kvferry_steps_total"] or 1
        lines.append(
            f"\n{s.mode} round: endpoint {u['kvferry_endpoint_rounds_total'] / s.seconds:.0f} wake-ups/s, "
            f"{100 * u['kvferry_endpoint_cpu_seconds_total'] / s.seconds:.2f} % of a core; worker hooks "
            f"{1e6 * u['kvferry_step_hook_seconds_total'] / steps:.1f} us per step over {steps:.0f} steps"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per cell")
    parser.add_argument("--core", default="1", help="the one core every server is pinned to")
    parser.add_argument("--out", type=Path, default=Path("bench/results/connector_idle_cost"))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "none" not in modes or set(modes) - set(MODES):
        parser.error(f"--modes: a subset of {list(MODES)} including none (the baseline)")
    sweep = loadbench.Sweep(
        url="", lengths=(args.length,), rates=(args.rate,), max_tokens=args.max_tokens,
        duration_s=args.duration, timeout_s=60.0,
    )  # fmt: skip
    model = ensure("llama")
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="idle-cost-") as tmp:
        for r in range(args.rounds):
            for mode in modes:
                print(f"== round {r + 1}: {mode}", flush=True)
                samples.append(measure(mode, model, sweep, args.core, Path(tmp)))
                print(f"   TTFT p50 {samples[-1].ttft_ms:.1f} ms, TPOT p50 {samples[-1].tpot_ms:.2f} ms")
    out = table(samples)
    command = f"python bench/connector_idle_cost.py {' '.join(argv if argv is not None else sys.argv[1:])}"
    print("\n" + out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    title = "# Connector cost with nothing to transfer"
    args.out.with_suffix(".md").write_text(f"{title}\n\n`{command}`\n\n{out}")
    args.out.with_suffix(".json").write_text(json.dumps([s.__dict__ for s in samples], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
