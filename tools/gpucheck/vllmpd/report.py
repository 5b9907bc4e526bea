"""What the check prints (the environment, each case, the summary table) and the JSON it writes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .cases import Case
from .probe import cuda_mismatch
from .results import CaseResult


def _fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _ms(value: float | None) -> str:
    return _fmt(value, ".2f", " ms")


def _gbps(value: float | None, spec: str = ".2f") -> str:
    return _fmt(value, spec, " GB/s")


def print_environment(
    cases: list[Case],
    workdir: Path,
    torch_version: str,
    torch_cuda: str | None,
    info: Mapping[str, Any],
    dists: Mapping[str, str],
) -> None:
    """The run's opening lines: cases, logs, versions, and warnings about the installed stack."""
    print(f"GPU check: {len(cases)} case(s); logs in {workdir}")
    print(f"  torch {torch_version} CUDA {torch_cuda}; " + ", ".join(f"{k} {v}" for k, v in info.items()))
    if warning := cuda_mismatch(torch_cuda, dists):
        print(f"  warn: {warning}")
    if any(c.attention == "FLASHINFER" for c in cases) and "flashinfer-python" not in dists:
        print("  warn: flashinfer-python is not installed: FLASHINFER cases will likely fail to start")


def _print_sequential(s: dict[str, Any]) -> None:
    modes = ", ".join(f"{m} {n:g}" for m, n in s["descriptor_modes"].items()) or "n/a"
    print(
        f"  KV {_mb(s['kv_bytes'])} in {s['producer_transfers']:g} WRITEs (descriptors: {modes}; "
        f"mean {_fmt(s['descriptors_mean'], '.1f')}), decode received {s['consumer_transfers']:g}, "
        f"failures {s['failures'] or 0}"
    )
    print(
        f"  WRITE latency mean {_ms(s['write_mean_ms'])}, p50 {_ms(s['write_p50_ms'])}, "
        f"p99 {_ms(s['write_p99_ms'])}; per-WRITE {_gbps(s['write_gbps'])}; "
        f"decode receive wait mean {_ms(s['receive_wait_mean_ms'])}"
    )


def _print_burst(b: dict[str, Any]) -> None:
    print(
        f"  throughput: {b['pairs']} concurrent pairs x {b['prompt_tokens']} tokens: "
        f"{_mb(b['kv_bytes'])} in {b['wall_s']:.2f} s wall = {_gbps(b['wall_gbps'], '.3f')}; "
        f"per-WRITE {_gbps(b['write_gbps'])} (WRITE p50 {_ms(b['write_p50_ms'])}, "
        f"p99 {_ms(b['write_p99_ms'])})"
    )


def _staged(value: bool | None, unknown: str = "unknown") -> str:
    return unknown if value is None else ("yes" if value else "no")


def print_staging(r: CaseResult) -> None:
    """Whether each server's kvferry layout line says `staged through host memory`."""
    if r.staged:
        roles = ", ".join(f"{role} {_staged(v)}" for role, v in r.staged.items())
        print(f"  staged through host memory (kv_buffer_device {r.kv_buffer_device}): {roles}")


def print_case(r: CaseResult) -> None:
    ties = f" (+{r.ties} near-tie)" if r.ties else ""
    print(f"[{r.case}] {'ok' if r.ok else 'FAIL'}: outputs {r.equal}/{r.total} equal{ties}")
    if r.sequential:
        _print_sequential(r.sequential)
    if r.burst:
        _print_burst(r.burst)
    print_staging(r)
    for role, lines in r.layout.items():
        for line in lines or ["(no kvferry or layout lines in the log)"]:
            print(f"  layout {role}: {line}")
    for m in r.mismatches:
        print(f"  DIFFERS {m}")
    for e in r.errors:
        print(f"  ERROR {e}")
    for w in r.warnings:
        print(f"  warn {w}")
    sys.stdout.flush()


def print_summary(results: list[CaseResult]) -> None:
    print("\n== summary")
    header = f"{'case':<40} {'outputs':>8} {'KV':>10} {'WRITE mean/p99 ms':>18} {'burst GB/s':>11}"
    print(f"{header} {'staged P/D':>10}  result")
    for r in results:
        s, b = r.sequential, r.burst
        kv = _mb(s["kv_bytes"]) if s else "-"
        lat = f"{_fmt(s.get('write_mean_ms'))}/{_fmt(s.get('write_p99_ms'))}" if s else "-"
        gbps = _fmt(b.get("wall_gbps"), ".3f") if b else "-"
        outputs = f"{r.equal}/{r.total}"
        staged = "/".join(_staged(r.staged.get(k), "?") for k in ("prefill", "decode")) if r.staged else "-"
        row = f"{r.case:<40} {outputs:>8} {kv:>10} {lat:>18} {gbps:>11} {staged:>10}"
        print(f"{row}  {'ok' if r.ok else 'FAIL'}")


def write_json(
    path: Path,
    passed: bool,
    elapsed: float,
    environment: dict[str, Any],
    args: argparse.Namespace,
    results: list[CaseResult],
) -> None:
    report = {
        "ok": passed,
        "elapsed_s": elapsed,
        "environment": environment,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cases": [{**asdict(r), "ok": r.ok} for r in results],
    }
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"results written to {path}")
