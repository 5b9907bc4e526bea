"""The command line: flags and their checks, the dry run, and main (dry run, SKIP, or run)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

from kvferry.tools.serve import SERVER_MODULE

from . import __doc__ as DESCRIPTION
from .cases import KV_BUFFER_DEVICES, Case, groups, matrix, parse_choices, parse_ints, parse_pairs
from .command import ATTENTION_ENV, CLI_MODULE, KV_LAYOUT_ENV, server_command
from .launch import Group
from .probe import installed_dists, skip_reason
from .run import run

ATTENTION_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
KV_CACHE_DTYPES = ("auto", "fp8")
BLOCK_PAIRS = "16:16,16:32"
LENGTHS = "5,17,300,1500"
NIXL_BACKENDS = ("UCX", "LIBFABRIC")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The package docstring as written, and every flag's default."""


def _matrix_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="run one case only (the first of the matrix)")
    p.add_argument(
        "--out", type=Path, metavar="FILE.json", help="write every result (and the environment) here"
    )
    p.add_argument(
        "--backend",
        default="UCX",
        choices=NIXL_BACKENDS,
        help="NIXL backend (kv_connector_extra_config.backends)",
    )
    p.add_argument(
        "--attention",
        nargs="+",
        default=list(ATTENTION_BACKENDS),
        metavar="NAME",
        help="attention backends to test",
    )
    p.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=list(KV_CACHE_DTYPES),
        metavar="DTYPE",
        help="--kv-cache-dtype values",
    )
    p.add_argument(
        "--kv-buffer-devices",
        default="cuda",
        metavar="DEV,...",
        help="kv_transfer_config.kv_buffer_device of P and D, one more matrix dimension "
        f"({', '.join(KV_BUFFER_DEVICES)}; cuda,cpu runs every case both ways): cuda: NIXL registers "
        "the GPU cache; cpu: host staging for nodes without GPUDirect RDMA",
    )
    p.add_argument("--block-pairs", default=BLOCK_PAIRS, metavar="P:D,...", help="prefill:decode block sizes")
    p.add_argument(
        "--lengths", default=LENGTHS, metavar="N,...", help="prompt lengths in tokens (one P/D pair each)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (greedy)")
    p.add_argument(
        "--burst",
        type=int,
        default=16,
        metavar="N",
        help="concurrent long-prompt pairs for the throughput line (0: none)",
    )
    p.add_argument(
        "--burst-len", type=int, default=1500, metavar="TOKENS", help="prompt length of the burst pairs"
    )


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="pass --enforce-eager (no CUDA graphs or compile: faster start-up)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.25,
        help="per server; P and two D servers run at once",
    )
    p.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES for every server (one device)")
    p.add_argument("--model", type=Path, help="a local model folder instead of building the tiny model")
    p.add_argument("--arch", default="llama", help="tinymodel architecture to build")
    p.add_argument("--dtype", default="bfloat16", help="vLLM --dtype")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len")
    p.add_argument(
        "--kv-cache-layout",
        metavar="NAME",
        help=f"set {KV_LAYOUT_ENV} for every server (e.g. LBHNC, LBNHC); default: vLLM's choice",
    )
    p.add_argument(
        "--launcher",
        default="auto",
        choices=("auto", "cli", "module"),
        help=f"cli: python -m {CLI_MODULE} serve MODEL; module: python -m {SERVER_MODULE} --model MODEL; "
        "auto: cli when the `vllm` distribution is installed",
    )
    p.add_argument(
        "--attention-via",
        default="auto",
        choices=("auto", "flag", "env"),
        help=f"--attention-backend or {ATTENTION_ENV}; auto: from `vllm serve --help`",
    )


def _run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tie-logprob",
        type=float,
        default=0.0,
        help="accept outputs parting where the reference's top-2 logprobs are within this (0: strict)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds a server may take to become healthy",
    )
    p.add_argument(
        "--request-timeout", type=float, default=120.0, metavar="S", help="HTTP timeout per request"
    )
    p.add_argument(
        "--metrics-wait",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for transfer counts to reach /metrics",
    )
    p.add_argument(
        "--workdir", type=Path, help="logs and the logging config go here (default: a new temp folder, kept)"
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        metavar="ARG",
        help="extra argument for every vLLM server (repeatable; use --vllm-arg=--flag)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the cases and server commands, start nothing (no GPU needed)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvferry gpu-check-vllm", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    _matrix_flags(p)
    _server_flags(p)
    _run_flags(p)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.pairs = parse_pairs(args.block_pairs)
        args.lengths_list = parse_ints(args.lengths)
        args.buffer_devices = parse_choices(args.kv_buffer_devices, KV_BUFFER_DEVICES, "--kv-buffer-devices")
    except ValueError as exc:
        parser.error(str(exc))
    longest = max([*args.lengths_list, args.burst_len if args.burst else 0])
    if longest + args.max_tokens > args.max_model_len:
        parser.error(
            f"prompts of {longest} tokens + {args.max_tokens} exceed --max-model-len {args.max_model_len}"
        )
    if not 0 < args.gpu_memory_utilization < 1:
        parser.error("--gpu-memory-utilization must be in (0, 1)")
    return args


def dry_run(args: argparse.Namespace, cases: list[Case]) -> int:
    """Print every group's server commands and cases; start nothing."""
    model = args.model or Path("<tiny model>")
    launcher = "cli" if args.launcher == "auto" else args.launcher
    via = "flag" if args.attention_via == "auto" else args.attention_via
    env = {"attention_via": via, "launcher": launcher, "log_config": None, "workdir": "<workdir>"}
    referenced: set[tuple[str, str]] = set()  # the single server runs once per (backend, dtype)
    for key, members in groups(cases).items():
        attention, kv_dtype, buffer = key
        group = Group(key, model, args, env)
        print(f"== {attention}, kv-cache-dtype {kv_dtype}, kv buffer {buffer}")
        roles = [] if (attention, kv_dtype) in referenced else [("single", members[0].p_block)]
        referenced.add((attention, kv_dtype))
        roles += sorted({("prefill", c.p_block) for c in members})
        roles += sorted({("decode", c.d_block) for c in members})
        for role, block in roles:
            spec = group.spec(role, block)
            extra = f"{ATTENTION_ENV}={attention} " if via == "env" else ""
            print(f"  {role}{block}: {extra}{shlex.join(server_command(spec))}")
        for c in members:
            print(f"  case {c.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = matrix(args.attention, args.kv_cache_dtypes, args.pairs, args.quick, args.buffer_devices)
    if args.dry_run:
        return dry_run(args, cases)
    dists = installed_dists()
    reason = skip_reason(dists)
    if reason:
        print(f"SKIP: {reason}", flush=True)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop the servers
    return run(args, cases, dists)
