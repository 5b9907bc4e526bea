"""Running the check on a GPU: per (backend, dtype) the single server's reference outputs (shared by
that pair's KV buffer devices), then per (backend, dtype, buffer device) group and case the P/D pairs
one after the other and in a burst, checked against /metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kvferry.tools.pdclient import prompt_body, token_prompt

from .cases import Case, groups
from .command import ATTENTION_ENV, logging_config
from .launch import GpuServer, Group, StartError, layout_lines, read_log, staged
from .metrics import transfer_stats, wait_for_counts
from .model import build_model, model_shape
from .probe import detect_attention_via, versions
from .report import print_case, print_environment, print_summary, write_json
from .results import CaseResult, case_checks, new_result, score_answers, staging_checks
from .traffic import References, pd_burst, pd_sequence, reference_outputs

Scrapes = tuple[dict[str, float], dict[str, float]]


def _sequential(
    result: CaseResult,
    p: GpuServer,
    d: GpuServer,
    reference: References,
    prompts: dict[str, list[int]],
    args: argparse.Namespace,
) -> Scrapes:
    """One pair per prompt, one after the other, compared with the reference; returns the scrapes after."""
    bodies = {k: prompt_body(v, args.max_tokens) for k, v in prompts.items()}
    p0, d0 = p.metrics(), d.metrics()
    answers = asyncio.run(pd_sequence(p, d, bodies, args.request_timeout))
    completed = score_answers(result, answers, reference, args.tie_logprob)
    p1, d1 = wait_for_counts(p, d, p0, d0, completed, args.metrics_wait)
    result.sequential = transfer_stats(p0, p1, d0, d1)
    case_checks(result, result.sequential, len(prompts), [len(v) for v in prompts.values()], "sequential")
    return p1, d1


def _burst(result: CaseResult, p: GpuServer, d: GpuServer, before: Scrapes, args: argparse.Namespace) -> None:
    """args.burst long-prompt pairs at once: the throughput line."""
    bodies = [
        prompt_body(token_prompt(args.burst_len, salt=i + 1), args.max_tokens) for i in range(args.burst)
    ]
    wall, answers = asyncio.run(pd_burst(p, d, bodies, args.request_timeout))
    failed = [a for a in answers if isinstance(a, Exception)]
    for exc in failed[:3]:
        result.errors.append(f"burst: {exc}")
    p1, d1 = before
    p2, d2 = wait_for_counts(p, d, p1, d1, len(bodies) - len(failed), args.metrics_wait)
    stats = transfer_stats(p1, p2, d1, d2)
    stats.update(pairs=len(bodies), prompt_tokens=args.burst_len, wall_s=wall, failed_requests=len(failed))
    stats["wall_gbps"] = stats["kv_bytes"] / wall / 1e9 if wall > 0 else None
    result.burst = stats
    case_checks(result, stats, len(bodies), [args.burst_len] * len(bodies), "burst")


def run_case(
    case: Case,
    p: GpuServer,
    d: GpuServer,
    reference: References,
    prompts: dict[str, list[int]],
    args: argparse.Namespace,
) -> CaseResult:
    result = new_result(case)
    after = _sequential(result, p, d, reference, prompts, args)
    if args.burst > 0:
        _burst(result, p, d, after, args)
    return result


def _reference(
    group: Group, block: int, prompts: dict[str, list[int]], args: argparse.Namespace
) -> References:
    """The single server's outputs; it is stopped after, its memory goes to P and D."""
    try:
        single = group.server("single", block)
        return asyncio.run(reference_outputs(single.url, prompts, args.max_tokens, args.request_timeout))
    finally:
        group.stop(("single", block))


def _pair_case(
    group: Group, case: Case, reference: References, prompts: dict[str, list[int]], args: argparse.Namespace
) -> CaseResult:
    """One case on the group's P and D (started on first use), printed when done."""
    result = new_result(case)
    try:
        p = group.server("prefill", case.p_block)
        d = group.server("decode", case.d_block)
    except StartError as exc:
        result.errors.append(str(exc))
        print_case(result)
        return result
    try:
        result = run_case(case, p, d, reference, prompts, args)
    except Exception as exc:  # a scrape or client failure ends this case, not the run
        result.errors.append(f"{type(exc).__name__}: {exc}")
    for role, server in (("prefill", p), ("decode", d)):
        text = read_log(server)
        result.layout[role] = layout_lines(text)
        result.staged[role] = staged(text)
        result.logs[role] = str(server.log_path)
    staging_checks(result)
    print_case(result)
    return result


def run_group(
    cases: list[Case],
    model: Path,
    args: argparse.Namespace,
    env: dict[str, Any],
    references: dict[tuple[str, str], References] | None = None,
) -> list[CaseResult]:
    """One group's cases; references caches the single server's outputs per (backend, dtype)."""
    attention, kv_dtype, buffer = cases[0].group
    group = Group(cases[0].group, model, args, env)
    prompts = {f"len{n}": token_prompt(n) for n in args.lengths_list}
    references = {} if references is None else references
    print(
        f"\n== {attention}, kv-cache-dtype {kv_dtype}, kv buffer {buffer}: {len(cases)} case(s)", flush=True
    )
    try:
        try:
            if (attention, kv_dtype) not in references:
                references[attention, kv_dtype] = _reference(group, cases[0].p_block, prompts, args)
            reference = references[attention, kv_dtype]
        except Exception as exc:  # start-up, HTTP or client failure: every case of the group fails
            failed = {c: new_result(c) for c in cases}
            for r in failed.values():
                r.errors.append(f"reference: {exc}")
                print_case(r)
            return list(failed.values())
        results = {case: _pair_case(group, case, reference, prompts, args) for case in cases}
        return list(results.values())
    finally:
        group.stop_all()


def _workdir(args: argparse.Namespace) -> tuple[Path, Path]:
    """The folder for logs (kept) and the vLLM logging config written into it."""
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvferry-gpucheck-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log_config = workdir / "logging.json"
    log_config.write_text(json.dumps(logging_config(), indent=1))
    return workdir, log_config


def _launch_mode(args: argparse.Namespace, dists: dict[str, str]) -> tuple[str, str]:
    """(launcher, attention_via), resolving `auto` from the installed vLLM."""
    launcher = args.launcher if args.launcher != "auto" else ("cli" if "vllm" in dists else "module")
    probe_env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.gpu}
    via = args.attention_via if args.attention_via != "auto" else detect_attention_via(launcher, probe_env)
    chooser = "--attention-backend" if via == "flag" else ATTENTION_ENV
    print(f"  launcher {launcher}; attention backend chosen by {chooser}")
    return launcher, via


def run(args: argparse.Namespace, cases: list[Case], dists: dict[str, str]) -> int:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t_start = time.monotonic()
    workdir, log_config = _workdir(args)
    info = versions(dists)
    print_environment(cases, workdir, torch.__version__, torch.version.cuda, info, dists)
    model, note = (args.model, "given with --model") if args.model else build_model(args.arch)
    shape = model_shape(model)
    print(f"  model {model} ({note}): {shape}")
    launcher, via = _launch_mode(args, dists)
    env = {"attention_via": via, "launcher": launcher, "log_config": log_config, "workdir": workdir}
    results: list[CaseResult] = []
    references: dict[
        tuple[str, str], References
    ] = {}  # the single server's outputs do not depend on the KV buffer device
    for members in groups(cases).values():
        results += run_group(members, model, args, env, references)
    print_summary(results)
    passed = all(r.ok for r in results)
    elapsed = time.monotonic() - t_start
    verdict = "PASSED" if passed else "FAILED"
    print(f"\nGPU check {verdict}: {sum(r.ok for r in results)}/{len(results)} cases ok in {elapsed:.0f} s")
    if args.out:
        environment: dict[str, Any] = {
            **info,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "launcher": launcher,
            "attention_via": via,
            "model": str(model),
            "model_note": note,
            "model_shape": shape,
        }
        write_json(args.out, passed, elapsed, environment, args, results)
    return 0 if passed else 1
