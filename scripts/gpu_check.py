#!/usr/bin/env python3
"""GPU check: kvferry P/D on one CUDA device against a single vLLM, in one command, no network.

    python scripts/gpu_check.py [--quick] [--out results.json] [--backend UCX] [--enforce-eager]

On a machine without a usable CUDA device (or without CUDA builds of vLLM and NIXL) it prints
`SKIP: <reason>` and exits 0 without starting anything. Otherwise it builds a random tiny model
locally (kvferry.local.tinymodel: 8 heads, 2 KV heads, head_dim 128, bfloat16 when tinymodel offers
those options) and, for every case of the matrix

    attention backend FLASH_ATTN, FLASHINFER  x  KV cache dtype auto, fp8  x  blocks P16/D16, P16/D32

compares the greedy token ids of a single vLLM (no connector; started and stopped before the pair)
with those of a prefill (kv_producer) and a decode (kv_consumer) vLLM running KvferryConnector on
the same GPU, the request pair sent straight to P and D with the contract's `kvferry` params (as in
tests/e2e/test_kvferry_connector_vllm.py). Per case it prints outputs equal/total, the KV bytes and
WRITE latency from P's and D's /metrics, a burst of concurrent long-prompt pairs as GB/s, and the KV
layout lines each server logged. The P server of a (backend, dtype) group serves all its cases.
Servers start one after the other (concurrent start-ups skew vLLM's GPU memory profiling): the full
matrix is 16 start-ups (4 groups of single, P, D16, D32), --quick 3; --enforce-eager starts faster.

Exit status: 0 when every case passed (or SKIP), 1 when an output differed, a transfer failed or a
server did not start (its log tail is printed), 2 for bad arguments. Every server binds 127.0.0.1
and runs in its own process group, stopped by PID in `finally`. Logs stay in --workdir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as md
import inspect
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvferry.connector.promtext import metric_sum
from kvferry.connector.serve import KVFERRY_CONNECTOR, ServerSpec, VllmProcess, free_port, kv_transfer_config

ATTENTION_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
KV_CACHE_DTYPES = ("auto", "fp8")
BLOCK_PAIRS = "16:16,16:32"
LENGTHS = "5,17,300,1500"
NIXL_BACKENDS = ("UCX", "LIBFABRIC")
SERVED_NAME = "tiny"
HOST = "127.0.0.1"
CLI_MODULE = "vllm.entrypoints.cli.main"  # `vllm serve`, without needing the console script on PATH
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ATTENTION_ENV = "VLLM_ATTENTION_BACKEND"  # how older vLLM releases pick the backend
KV_LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"
CPU_ONLY_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
DEADLINE_S = 60.0
# The model shape this check wants, by option; tinymodel names may differ (see shape_overrides).
SHAPE = {"heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16"}
SHAPE_ALIASES = {
    "heads": ("heads", "num_heads", "num_attention_heads", "n_heads"),
    "kv_heads": ("kv_heads", "num_kv_heads", "num_key_value_heads", "n_kv_heads"),
    "head_dim": ("head_dim", "head_size"),
    "dtype": ("dtype", "torch_dtype"),
}
HF_NAMES = {"heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim"}
VLLM_LOG_RE = re.compile(r"KV cache layout|Using \S+ backend|attention backend", re.IGNORECASE)
NOISE_RE = re.compile(r"kv_transfer_config|KVTransferConfig|non-default args", re.IGNORECASE)
LINE_CHARS = 300


# ---------------------------------------------------------------- environment: run or SKIP


def installed_dists() -> dict[str, str]:
    """Installed distributions, lower-case name -> version (no package is imported)."""
    out: dict[str, str] = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name:
            out.setdefault(name, dist.version)
    return out


def stack_problems(dists: Mapping[str, str]) -> list[str]:
    """Why the installed vLLM / NIXL cannot run on a GPU (empty: CUDA builds of both are there)."""
    problems = []
    vllm = dists.get("vllm")
    others = sorted(
        n for n in dists if n.startswith("vllm-") and n.split("-", 1)[1] in ("cpu", "neuron", "tpu")
    )
    if vllm is None:
        problems.append(
            f"vLLM is a non-CUDA build ({', '.join(f'{n} {dists[n]}' for n in others)})"
            if others
            else "vLLM is not installed"
        )
    elif "+cpu" in vllm:
        problems.append(f"vLLM {vllm} is a CPU build")
    cuda_nixl = sorted(n for n in dists if re.fullmatch(r"nixl-cu\d+", n))
    if not cuda_nixl:
        problems.append(
            f"NIXL {dists['nixl']} has no CUDA build (no nixl-cu* distribution)"
            if "nixl" in dists
            else "NIXL is not installed"
        )
    return problems


def torch_problem() -> str | None:
    """None when torch sees a CUDA device; else why not. Imports torch, never vLLM."""
    try:
        import torch
    except Exception as exc:  # a broken install is a reason to skip, not a crash
        return f"torch is not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return (
            f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'}) "
            "reports torch.cuda.is_available() False"
        )
    return None


def skip_reason(dists: Mapping[str, str] | None = None) -> str | None:
    problems = [p for p in [torch_problem()] if p]
    problems += stack_problems(installed_dists() if dists is None else dists)
    return "; ".join(problems) or None


def cuda_mismatch(torch_cuda: str | None, dists: Mapping[str, str]) -> str | None:
    """A warning when NIXL's CUDA major differs from torch's (UCX's CUDA transports may not load)."""
    majors = sorted(n.removeprefix("nixl-cu") for n in dists if re.fullmatch(r"nixl-cu\d+", n))
    want = (torch_cuda or "").split(".")[0]
    if want and majors and want not in majors:
        return f"torch is built for CUDA {torch_cuda}, NIXL for CUDA {', '.join(majors)}"
    return None


# ---------------------------------------------------------------- model


def shape_overrides(
    ensure_params: Iterable[str], shape_params: Iterable[str] | None = None, var_keyword: bool = False
) -> tuple[str, dict[str, Any], list[str]]:
    """How to ask tinymodel.ensure for SHAPE: (how, kwargs, options it cannot take).

    how is "shape" (ensure takes `shape=Shape(...)`: kwargs are Shape's), "kwargs" (ensure takes the
    options itself), or "none" (only arch: the default shape is built)."""
    ensure_params = list(ensure_params)
    via_shape = "shape" in ensure_params and shape_params is not None
    target = list(shape_params or ()) if via_shape else ensure_params
    kwargs, missing = {}, []
    for option, value in SHAPE.items():
        name = next((a for a in SHAPE_ALIASES[option] if a in target), None)
        if name is None:
            missing.append(option)
        else:
            kwargs[name] = value
    if via_shape and kwargs:
        return "shape", kwargs, missing
    if not kwargs and var_keyword:  # ensure(arch, **overrides): give HF config names
        return "kwargs", {HF_NAMES.get(k, k): v for k, v in SHAPE.items()}, []
    return ("kwargs" if kwargs else "none"), kwargs, missing


def build_model(arch: str) -> tuple[Path, str]:
    """The tiny model (built locally, cached) and a note on which shape options were applied."""
    from kvferry.local import tinymodel

    ensure = tinymodel.ensure
    params = inspect.signature(ensure).parameters
    shape_cls = getattr(tinymodel, "Shape", None)
    shape_params = list(inspect.signature(shape_cls).parameters) if shape_cls is not None else None
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    how, kwargs, missing = shape_overrides(params, shape_params, var_kw)
    if how == "shape":
        assert shape_cls is not None
        path = ensure(arch, shape=shape_cls(**kwargs))
    else:
        path = ensure(arch, **kwargs)
    note = (
        f"shape options {sorted(kwargs)} via {how}" if kwargs else "tinymodel takes only arch: default shape"
    )
    if missing:
        note += f"; not available in tinymodel: {missing}"
    return path, note


def model_shape(model: Path) -> dict[str, Any]:
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    out = {k: config.get(k) for k in keys}
    out["dtype"] = config.get("dtype") or config.get("torch_dtype")
    return out


# ---------------------------------------------------------------- the matrix and its servers


@dataclass(frozen=True)
class Case:
    attention: str
    kv_dtype: str
    p_block: int
    d_block: int

    @property
    def group(self) -> tuple[str, str]:
        return self.attention, self.kv_dtype

    @property
    def name(self) -> str:
        return f"{self.attention}/kv={self.kv_dtype}/P{self.p_block}-D{self.d_block}"


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """'16:16,16:32' -> [(16, 16), (16, 32)]."""
    pairs = []
    for part in text.split(","):
        p, sep, d = part.strip().partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) <= 0 or int(d) <= 0:
            raise ValueError(f"block pair {part!r} is not P:D (two positive integers)")
        pairs.append((int(p), int(d)))
    return pairs


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise ValueError(f"{text!r}: give positive integers separated by commas")
    return values


def matrix(
    attention: list[str], kv_dtypes: list[str], pairs: list[tuple[int, int]], quick: bool = False
) -> list[Case]:
    """Every case, grouped by (backend, dtype) in order; --quick: the first case only."""
    cases = [Case(a, k, p, d) for a in attention for k in kv_dtypes for p, d in pairs]
    return cases[:1] if quick else cases


def groups(cases: list[Case]) -> dict[tuple[str, str], list[Case]]:
    out: dict[tuple[str, str], list[Case]] = {}
    for case in cases:
        out.setdefault(case.group, []).append(case)
    return out


@dataclass(frozen=True)
class GpuServerSpec:
    """One vLLM server on the GPU: role in the pair, attention backend, KV dtype and block size."""

    model: Path
    port: int
    role: str  # single | prefill | decode
    attention: str
    kv_dtype: str
    block_size: int
    engine_id: str | None = None
    side_port: int | None = None
    nixl_backend: str = "UCX"
    gpu: str = "0"  # CUDA_VISIBLE_DEVICES
    gpu_memory_utilization: float = 0.25
    enforce_eager: bool = False
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    attention_via: str = "flag"  # flag: --attention-backend; env: VLLM_ATTENTION_BACKEND
    launcher: str = "cli"  # cli: vllm serve MODEL; module: the api_server module --model MODEL
    kv_cache_layout: str | None = None  # VLLM_KV_CACHE_LAYOUT, when set
    log_config: Path | None = None  # VLLM_LOGGING_CONFIG_PATH: makes the kvferry logger visible
    extra_args: tuple[str, ...] = ()

    def server_spec(self) -> ServerSpec:
        """The launcher's spec (serve.py) for what it shares: role checks, URL, kv-transfer-config."""
        connector = None if self.role == "single" else KVFERRY_CONNECTOR
        return ServerSpec(
            model=self.model,
            port=self.port,
            role=self.role,
            connector=connector,
            engine_id=self.engine_id,
            side_port=self.side_port,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            served_name=SERVED_NAME,
            host=HOST,
            connector_extra={"backends": [self.nixl_backend], "deadline_s": DEADLINE_S},
        )


def gpu_kv_transfer_config(spec: GpuServerSpec) -> dict[str, Any] | None:
    """serve.py's --kv-transfer-config for the role, with the KV buffer on the GPU."""
    config = kv_transfer_config(spec.server_spec())
    if config is not None:
        config["kv_buffer_device"] = "cuda"
    return config


def launcher_prefix(kind: str, python: str = sys.executable) -> list[str]:
    """Everything before the model path."""
    if kind == "cli":
        return [python, "-m", CLI_MODULE, "serve"]
    if kind == "module":
        return [python, "-m", SERVER_MODULE, "--model"]
    raise ValueError(f"launcher {kind!r} is not cli or module")


def help_command(kind: str, python: str = sys.executable, all_groups: bool = False) -> list[str]:
    base = [python, "-m", CLI_MODULE, "serve"] if kind == "cli" else [python, "-m", SERVER_MODULE]
    return [*base, "--help=all" if all_groups else "--help"]


def server_command(spec: GpuServerSpec, python: str = sys.executable) -> list[str]:
    cmd = [*launcher_prefix(spec.launcher, python), str(spec.model), "--served-model-name", SERVED_NAME]
    cmd += ["--host", HOST, "--port", str(spec.port), "--dtype", spec.dtype]
    cmd += ["--max-model-len", str(spec.max_model_len), "--block-size", str(spec.block_size)]
    cmd += ["--gpu-memory-utilization", f"{spec.gpu_memory_utilization:g}", "--kv-cache-dtype", spec.kv_dtype]
    cmd += ["--no-enable-prefix-caching", "--seed", "0"]  # P/D legs must not hit a local prefix cache
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    if spec.attention_via == "flag":
        cmd += ["--attention-backend", spec.attention]
    config = gpu_kv_transfer_config(spec)
    if config is not None:
        cmd += ["--kv-transfer-config", json.dumps(config)]
    return cmd + list(spec.extra_args)


def server_env(spec: GpuServerSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment: the GPU, offline hub, loopback, backend by env for older vLLM."""
    env = dict(os.environ if base is None else base)
    for name in (*CPU_ONLY_ENV, ATTENTION_ENV, KV_LAYOUT_ENV):
        env.pop(name, None)
    env.update(
        CUDA_VISIBLE_DEVICES=spec.gpu,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
        VLLM_HOST_IP=HOST,
    )
    if spec.attention_via == "env":
        env[ATTENTION_ENV] = spec.attention
    if spec.kv_cache_layout:
        env[KV_LAYOUT_ENV] = spec.kv_cache_layout
    if spec.log_config is not None:
        env["VLLM_LOGGING_CONFIG_PATH"] = str(spec.log_config)
    return env


def logging_config() -> dict[str, Any]:
    """vLLM's logging config only attaches a handler to the `vllm` logger, so the connector's INFO
    lines (`kvferry.*`, e.g. its layout at start-up) would be dropped: give both loggers one."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {
                "format": "%(levelname)s %(asctime)s %(process)d [%(name)s] %(message)s",
                "datefmt": "%m-%d %H:%M:%S",
            }
        },
        "handlers": {
            "out": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "level": "INFO",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {
            name: {"handlers": ["out"], "level": "INFO", "propagate": False} for name in ("vllm", "kvferry")
        },
    }


class GpuServer(VllmProcess):
    """serve.py's VllmProcess (own process group, /health wait, scrape, stop by PID), GPU command."""

    def __init__(self, spec: GpuServerSpec, log_path: Path) -> None:
        super().__init__(spec.server_spec(), log_path)
        self.gspec = spec

    def start(self) -> GpuServer:
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            server_command(self.gspec),
            env=server_env(self.gspec),
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() reaches engine core and workers
        )
        return self


def run_capture(cmd: list[str], env: Mapping[str, str], timeout_s: float) -> str:
    """stdout+stderr of a short command in its own process group (killed by group on timeout)."""
    proc = subprocess.Popen(
        cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out.decode(errors="replace")


def attention_via_from_help(*texts: str) -> str:
    return "flag" if any("--attention-backend" in t for t in texts) else "env"


def detect_attention_via(launcher: str, env: Mapping[str, str], timeout_s: float = 300.0) -> str:
    """flag when `vllm serve --help` lists --attention-backend (recent vLLM), else env."""
    text = run_capture(help_command(launcher), env, timeout_s)
    if "--attention-backend" not in text and "--help=" in text:  # grouped help: ask for all groups
        return attention_via_from_help(
            text, run_capture(help_command(launcher, all_groups=True), env, timeout_s)
        )
    return attention_via_from_help(text)


# ---------------------------------------------------------------- requests


def token_prompt(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of exactly `length` token ids above the special tokens."""
    return [10 + (i * 7919 + length + salt * 104729) % 2000 for i in range(length)]


def completion_body(prompt: list[int], max_tokens: int, logprobs: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        "return_token_ids": True,
    }
    if logprobs:
        body["logprobs"] = logprobs
    return body


def pd_legs(
    body: dict[str, Any], rid: str, *, producer: GpuServerSpec, consumer: GpuServerSpec, attempt: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill leg, decode leg) carrying the contract's kvferry params (docs/contracts.md §1)."""
    prefill = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "kvferry": {
                "v": 1,
                "request_id": rid,
                "attempt": attempt,
                "role": "producer",
                "consumer": {"engine_id": consumer.engine_id},
                "deadline_s": DEADLINE_S,
            },
        },
    }
    decode = {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "kvferry": {
                "v": 1,
                "request_id": rid,
                "attempt": attempt,
                "role": "consumer",
                "producer": {
                    "engine_id": producer.engine_id,
                    "host": HOST,
                    "port": producer.side_port,
                    "tp_size": 1,
                },
                "deadline_s": DEADLINE_S,
            },
        },
    }
    return prefill, decode


def top2_gaps(choice: Mapping[str, Any]) -> list[float]:
    """Per generated position of a completions choice: best minus second-best logprob."""
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    out = []
    for t in tops:
        values = sorted((t or {}).values(), reverse=True)
        out.append(values[0] - values[1] if len(values) > 1 else math.inf)
    return out


def compare(want: list[int], got: list[int] | None, gaps: list[float], tie: float = 0.0) -> tuple[str, str]:
    """('equal' | 'tie' | 'differs', detail). 'tie': the outputs part where the reference's top-2
    logprobs are within `tie` (0 = strict: any difference differs)."""
    if got == want:
        return "equal", ""
    got = got or []
    at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if at is None:
        return "differs", f"{len(got)} tokens, reference {len(want)}"
    gap = gaps[at] if at < len(gaps) else math.inf
    detail = f"token {at} is {got[at]}, reference {want[at]} (reference top-2 gap {gap:.1e})"
    return ("tie" if tie > 0 and gap <= tie else "differs"), detail


class RequestError(RuntimeError):
    pass


async def _post(client: Any, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict:
    resp = await client.post(url + "/v1/completions", json=body, headers=headers)
    if resp.status_code != 200:
        raise RequestError(f"{url}: HTTP {resp.status_code} {resp.text[:300]}")
    return resp.json()["choices"][0]


async def reference_outputs(
    url: str, prompts: dict[str, list[int]], max_tokens: int, timeout_s: float
) -> dict:
    import httpx

    out = {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for key, prompt in prompts.items():
            choice = await _post(client, url, completion_body(prompt, max_tokens, logprobs=2))
            out[key] = {"token_ids": choice.get("token_ids") or [], "gaps": top2_gaps(choice)}
    return out


async def pd_pair(client: Any, p: GpuServer, d: GpuServer, body: dict[str, Any]) -> dict:
    rid = uuid.uuid4().hex
    prefill, decode = pd_legs(body, rid, producer=p.gspec, consumer=d.gspec)
    headers = {"X-Request-Id": rid}
    _, choice = await asyncio.gather(
        _post(client, p.url, prefill, headers), _post(client, d.url, decode, headers)
    )
    return choice


async def pd_sequence(p: GpuServer, d: GpuServer, bodies: dict[str, dict], timeout_s: float) -> dict:
    """Pairs one after the other; a failed pair is recorded, not raised."""
    import httpx

    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for key, body in bodies.items():
            try:
                out[key] = await pd_pair(client, p, d, body)
            except Exception as exc:
                out[key] = exc
    return out


async def pd_burst(p: GpuServer, d: GpuServer, bodies: list[dict], timeout_s: float) -> tuple[float, list]:
    """All pairs at once; (wall seconds, results or exceptions)."""
    import httpx

    limits = httpx.Limits(max_connections=4 * len(bodies) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(pd_pair(client, p, d, b) for b in bodies), return_exceptions=True)
        return time.perf_counter() - t0, list(results)


# ---------------------------------------------------------------- metrics


def _labels(key: str) -> dict[str, str]:
    _, _, rest = key.partition("{")
    return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))


def delta(before: Mapping[str, float], after: Mapping[str, float], name: str, **labels: str) -> float:
    return metric_sum(dict(after), name, **labels) - metric_sum(dict(before), name, **labels)


def by_label(before: Mapping[str, float], after: Mapping[str, float], name: str, label: str) -> dict:
    """Non-zero deltas of `name` summed per value of `label`."""
    out: dict[str, float] = {}
    for key in set(before) | set(after):
        if key.partition("{")[0] != name:
            continue
        value = _labels(key).get(label, "")
        out[value] = out.get(value, 0.0) + after.get(key, 0.0) - before.get(key, 0.0)
    return {k: v for k, v in sorted(out.items()) if v}


@dataclass
class Hist:
    buckets: list[tuple[float, float]] = field(default_factory=list)  # (upper bound, cumulative count)
    total: float = 0.0  # sum of observations
    count: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


def hist_delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> Hist:
    """A histogram's change between two scrapes, summed over all labels but `le`."""
    counts: dict[float, float] = {}
    for key in set(before) | set(after):
        if key.partition("{")[0] != f"{name}_bucket":
            continue
        le = _labels(key).get("le")
        if le is None:
            continue
        bound = math.inf if le in ("+Inf", "inf") else float(le)
        counts[bound] = counts.get(bound, 0.0) + after.get(key, 0.0) - before.get(key, 0.0)
    return Hist(
        sorted(counts.items()), delta(before, after, f"{name}_sum"), delta(before, after, f"{name}_count")
    )


def hist_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus histogram_quantile: linear within the bucket holding rank q * count."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cum in buckets:
        if cum >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is all we know
            inside = cum - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cum
    return lower


def transfer_stats(
    p_before: Mapping[str, float],
    p_after: Mapping[str, float],
    d_before: Mapping[str, float],
    d_after: Mapping[str, float],
) -> dict[str, Any]:
    """What the pair's /metrics say moved between two scrapes."""
    write = hist_delta(p_before, p_after, "kvferry_match_to_done_seconds")
    recv = hist_delta(d_before, d_after, "kvferry_receive_wait_seconds")
    desc = hist_delta(p_before, p_after, "kvferry_descriptors_per_transfer")
    kv_bytes = delta(p_before, p_after, "kvferry_transfer_bytes_total")
    failures = by_label(p_before, p_after, "kvferry_transfer_failures_total", "reason")
    for reason, n in by_label(d_before, d_after, "kvferry_transfer_failures_total", "reason").items():
        failures[f"consumer:{reason}"] = n
    ms = 1000.0
    return {
        "kv_bytes": kv_bytes,
        "producer_transfers": delta(p_before, p_after, "kvferry_transfers_total", role="producer"),
        "consumer_transfers": delta(d_before, d_after, "kvferry_transfers_total", role="consumer"),
        "failures": failures,
        "rejected": by_label(p_before, p_after, "kvferry_rejected_messages_total", "reason")
        | {
            f"consumer:{k}": v
            for k, v in by_label(d_before, d_after, "kvferry_rejected_messages_total", "reason").items()
        },
        "write_count": write.count,
        "write_mean_ms": None if write.mean is None else write.mean * ms,
        "write_p50_ms": _scaled(hist_quantile(write.buckets, 0.5), ms),
        "write_p99_ms": _scaled(hist_quantile(write.buckets, 0.99), ms),
        "write_gbps": kv_bytes / write.total / 1e9 if write.total > 0 else None,
        "receive_wait_mean_ms": None if recv.mean is None else recv.mean * ms,
        "descriptor_modes": by_label(p_before, p_after, "kvferry_descriptors_per_transfer_count", "mode"),
        "descriptors_mean": desc.mean,
        "handoffs": by_label(p_before, p_after, "kvferry_prefill_handoffs_total", "when"),
        "tokens_external": delta(
            d_before, d_after, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        ),
        "tokens_local": delta(
            d_before, d_after, "vllm:prompt_tokens_by_source_total", source="local_compute"
        ),
        "has_source_metric": any(k.startswith("vllm:prompt_tokens_by_source_total") for k in d_after),
    }


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def wait_for_counts(
    p: GpuServer, d: GpuServer, base_p: dict, base_d: dict, want: int, timeout_s: float
) -> tuple:
    """Scrape until both sides report `want` more transfers (the worker journal reaches /metrics
    with vLLM's next stats) or time runs out; returns the last (P, D) scrapes."""
    deadline = time.monotonic() + timeout_s
    while True:
        p_now, d_now = p.metrics(), d.metrics()
        done_p = delta(base_p, p_now, "kvferry_transfers_total", role="producer") >= want
        done_d = delta(base_d, d_now, "kvferry_transfers_total", role="consumer") >= want
        if (done_p and done_d) or time.monotonic() > deadline:
            return p_now, d_now
        time.sleep(0.5)


# ---------------------------------------------------------------- logs


def layout_lines(text: str, limit: int = 4) -> list[str]:
    """The connector's layout lines (kvferry ... layout); without them its first kvferry lines;
    plus vLLM's own attention-backend and KV-cache-layout lines."""
    lines = [ln.strip()[:LINE_CHARS] for ln in text.splitlines() if ln.strip() and not NOISE_RE.search(ln)]
    kvferry = [ln for ln in lines if "kvferry" in ln.lower()]
    chosen = [ln for ln in kvferry if "layout" in ln.lower()] or kvferry
    vllm = [ln for ln in lines if VLLM_LOG_RE.search(ln) and ln not in chosen]
    return chosen[:limit] + vllm[:limit]


def read_log(server: VllmProcess) -> str:
    path = server.log_path
    return path.read_bytes().decode(errors="replace") if path is not None and path.exists() else ""


# ---------------------------------------------------------------- running the cases


@dataclass
class CaseResult:
    case: str
    attention: str
    kv_dtype: str
    p_block: int
    d_block: int
    equal: int = 0
    ties: int = 0
    total: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sequential: dict[str, Any] = field(default_factory=dict)
    burst: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, list[str]] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and not self.mismatches
            and self.total > 0
            and self.equal + self.ties == self.total
        )


def new_result(case: Case) -> CaseResult:
    return CaseResult(case.name, case.attention, case.kv_dtype, case.p_block, case.d_block)


def case_checks(result: CaseResult, stats: dict[str, Any], pairs: int, lengths: list[int], what: str) -> None:
    """Hard checks on one batch's metrics (errors) and soft ones (warnings)."""
    if stats["failures"]:
        result.errors.append(f"{what}: transfer failures {stats['failures']}")
    if stats["consumer_transfers"] != pairs:
        result.errors.append(f"{what}: decode received {stats['consumer_transfers']:g} of {pairs} transfers")
    if stats["kv_bytes"] <= 0:
        result.errors.append(f"{what}: prefill reports no KV bytes moved")
    if stats["producer_transfers"] != pairs:
        result.warnings.append(f"{what}: prefill reported {stats['producer_transfers']:g} of {pairs} WRITEs")
    if stats["has_source_metric"] and lengths and stats["tokens_external"] < sum(n - 1 for n in lengths):
        result.errors.append(
            f"{what}: decode got {stats['tokens_external']:g} prompt tokens as KV, expected "
            f">= {sum(n - 1 for n in lengths)} (it recomputed instead)"
        )
    if stats["rejected"]:
        result.warnings.append(f"{what}: rejected messages {stats['rejected']}")


def run_case(
    case: Case,
    p: GpuServer,
    d: GpuServer,
    reference: dict,
    prompts: dict[str, list[int]],
    args: argparse.Namespace,
) -> CaseResult:
    result = new_result(case)
    bodies = {k: completion_body(v, args.max_tokens) for k, v in prompts.items()}
    p0, d0 = p.metrics(), d.metrics()
    answers = asyncio.run(pd_sequence(p, d, bodies, args.request_timeout))
    ok_pairs = 0
    for key, answer in answers.items():
        result.total += 1
        if isinstance(answer, Exception):
            result.errors.append(f"{key}: {answer}")
            continue
        ok_pairs += 1
        status, detail = compare(
            reference[key]["token_ids"], answer.get("token_ids"), reference[key]["gaps"], args.tie_logprob
        )
        if status == "equal":
            result.equal += 1
        elif status == "tie":
            result.ties += 1
            result.warnings.append(f"{key}: parted at a near-tie: {detail}")
        else:
            result.mismatches.append(f"{key}: {detail}")
    p1, d1 = wait_for_counts(p, d, p0, d0, ok_pairs, args.metrics_wait)
    result.sequential = transfer_stats(p0, p1, d0, d1)
    case_checks(result, result.sequential, len(prompts), [len(v) for v in prompts.values()], "sequential")
    if args.burst > 0:
        burst = [
            completion_body(token_prompt(args.burst_len, salt=i + 1), args.max_tokens)
            for i in range(args.burst)
        ]
        wall, answers_b = asyncio.run(pd_burst(p, d, burst, args.request_timeout))
        failed = [a for a in answers_b if isinstance(a, Exception)]
        for exc in failed[:3]:
            result.errors.append(f"burst: {exc}")
        p2, d2 = wait_for_counts(p, d, p1, d1, len(burst) - len(failed), args.metrics_wait)
        stats = transfer_stats(p1, p2, d1, d2)
        stats.update(pairs=len(burst), prompt_tokens=args.burst_len, wall_s=wall, failed_requests=len(failed))
        stats["wall_gbps"] = stats["kv_bytes"] / wall / 1e9 if wall > 0 else None
        result.burst = stats
        case_checks(result, stats, len(burst), [args.burst_len] * len(burst), "burst")
    return result


class StartError(RuntimeError):
    pass


class Group:
    """The servers of one (backend, dtype) group: started on first use, stopped together."""

    def __init__(
        self, attention: str, kv_dtype: str, model: Path, args: argparse.Namespace, env: dict
    ) -> None:
        self.attention, self.kv_dtype, self.model, self.args, self.env = attention, kv_dtype, model, args, env
        self.servers: dict[tuple[str, int], GpuServer] = {}
        self.failed: dict[tuple[str, int], str] = {}
        self.tag = f"{attention.lower()}-{kv_dtype}"

    def spec(self, role: str, block: int) -> GpuServerSpec:
        connector = role != "single"
        return GpuServerSpec(
            model=self.model,
            port=free_port(HOST),
            role=role,
            attention=self.attention,
            kv_dtype=self.kv_dtype,
            block_size=block,
            engine_id=f"gpucheck-{role}-{block}-{uuid.uuid4().hex[:6]}" if connector else None,
            side_port=free_port(HOST) if connector else None,
            nixl_backend=self.args.backend,
            gpu=self.args.gpu,
            gpu_memory_utilization=self.args.gpu_memory_utilization,
            enforce_eager=self.args.enforce_eager,
            dtype=self.args.dtype,
            max_model_len=self.args.max_model_len,
            attention_via=self.env["attention_via"],
            launcher=self.env["launcher"],
            kv_cache_layout=self.args.kv_cache_layout,
            log_config=self.env["log_config"],
            extra_args=tuple(self.args.vllm_arg or ()),
        )

    def server(self, role: str, block: int) -> GpuServer:
        key = (role, block)
        if key in self.failed:
            raise StartError(self.failed[key])
        if key not in self.servers:
            log = Path(self.env["workdir"]) / f"{self.tag}-{role}{block}.log"
            server = GpuServer(self.spec(role, block), log)
            self.servers[key] = server
            t0 = time.monotonic()
            print(f"  starting {role} (block {block}) on :{server.spec.port}, log {log}", flush=True)
            try:
                server.start().wait_ready(self.args.ready_timeout)
            except (RuntimeError, TimeoutError) as exc:
                server.stop()
                head = str(exc).partition(": ")[
                    0
                ]  # "vLLM decode exited with 1", "... not healthy after 600s"
                self.failed[key] = f"{role} server (block {block}) did not start ({head}); log {log}"
                print(f"  FAILED: {self.failed[key]}; log tail:\n{server.log_tail(4000)}", flush=True)
                raise StartError(self.failed[key]) from None
            print(f"  {role} ready in {time.monotonic() - t0:.0f}s", flush=True)
        return self.servers[key]

    def stop(self, key: tuple[str, int]) -> None:
        server = self.servers.get(key)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


def run_group(cases: list[Case], model: Path, args: argparse.Namespace, env: dict) -> list[CaseResult]:
    attention, kv_dtype = cases[0].group
    group = Group(attention, kv_dtype, model, args, env)
    results = {c: new_result(c) for c in cases}
    prompts = {f"len{n}": token_prompt(n) for n in args.lengths_list}
    print(f"\n== {attention}, kv-cache-dtype {kv_dtype}: {len(cases)} case(s)", flush=True)
    try:
        try:
            single = group.server("single", cases[0].p_block)
            reference = asyncio.run(
                reference_outputs(single.url, prompts, args.max_tokens, args.request_timeout)
            )
        except Exception as exc:  # start-up, HTTP or client failure: every case of the group fails
            for r in results.values():
                r.errors.append(f"reference: {exc}")
                print_case(r)
            return list(results.values())
        finally:
            group.stop(("single", cases[0].p_block))  # its memory goes to P and D
        for case in cases:
            result = results[case]
            try:
                p = group.server("prefill", case.p_block)
                d = group.server("decode", case.d_block)
            except StartError as exc:
                result.errors.append(str(exc))
                print_case(result)
                continue
            try:
                results[case] = result = run_case(case, p, d, reference, prompts, args)
            except Exception as exc:  # a scrape or client failure ends this case, not the run
                result.errors.append(f"{type(exc).__name__}: {exc}")
            for role, server in (("prefill", p), ("decode", d)):
                result.layout[role] = layout_lines(read_log(server))
                result.logs[role] = str(server.log_path)
            print_case(result)
    finally:
        group.stop_all()
    return list(results.values())


# ---------------------------------------------------------------- report


def _fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _ms(value: float | None) -> str:
    return _fmt(value, ".2f", " ms")


def _gbps(value: float | None, spec: str = ".2f") -> str:
    return _fmt(value, spec, " GB/s")


def print_case(r: CaseResult) -> None:
    s, b = r.sequential, r.burst
    ties = f" (+{r.ties} near-tie)" if r.ties else ""
    print(f"[{r.case}] {'ok' if r.ok else 'FAIL'}: outputs {r.equal}/{r.total} equal{ties}")
    if s:
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
    if b:
        print(
            f"  throughput: {b['pairs']} concurrent pairs x {b['prompt_tokens']} tokens: "
            f"{_mb(b['kv_bytes'])} in {b['wall_s']:.2f} s wall = {_gbps(b['wall_gbps'], '.3f')}; "
            f"per-WRITE {_gbps(b['write_gbps'])} (WRITE p50 {_ms(b['write_p50_ms'])}, "
            f"p99 {_ms(b['write_p99_ms'])})"
        )
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
    print(f"{'case':<34} {'outputs':>8} {'KV':>10} {'WRITE mean/p99 ms':>18} {'burst GB/s':>11}  result")
    for r in results:
        s, b = r.sequential, r.burst
        kv = _mb(s["kv_bytes"]) if s else "-"
        lat = f"{_fmt(s.get('write_mean_ms'))}/{_fmt(s.get('write_p99_ms'))}" if s else "-"
        gbps = _fmt(b.get("wall_gbps"), ".3f") if b else "-"
        outputs = f"{r.equal}/{r.total}"
        print(f"{r.case:<34} {outputs:>8} {kv:>10} {lat:>18} {gbps:>11}  {'ok' if r.ok else 'FAIL'}")


def versions(dists: Mapping[str, str]) -> dict[str, Any]:
    keys = sorted(
        n for n in dists if n in ("vllm", "torch", "nixl", "flashinfer-python") or n.startswith("nixl-cu")
    )
    out: dict[str, Any] = {k: dists[k] for k in keys}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = run_capture(
            [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], os.environ, 30
        )
        out["gpus"] = [ln.strip() for ln in q.splitlines() if ln.strip()]
    return out


# ---------------------------------------------------------------- command line


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__, formatter_class=_HelpFormatter)
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
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.pairs = parse_pairs(args.block_pairs)
        args.lengths_list = parse_ints(args.lengths)
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
    model = args.model or Path("<tiny model>")
    launcher = "cli" if args.launcher == "auto" else args.launcher
    via = "flag" if args.attention_via == "auto" else args.attention_via
    env = {"attention_via": via, "launcher": launcher, "log_config": None, "workdir": "<workdir>"}
    for (attention, kv_dtype), members in groups(cases).items():
        group = Group(attention, kv_dtype, model, args, env)
        print(f"== {attention}, kv-cache-dtype {kv_dtype}")
        roles = [("single", members[0].p_block)]
        roles += sorted({("prefill", c.p_block) for c in members}) + sorted(
            {("decode", c.d_block) for c in members}
        )
        for role, block in roles:
            spec = group.spec(role, block)
            extra = f"{ATTENTION_ENV}={attention} " if via == "env" else ""
            print(f"  {role}{block}: {extra}{shlex.join(server_command(spec))}")
        for c in members:
            print(f"  case {c.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = matrix(args.attention, args.kv_cache_dtypes, args.pairs, args.quick)
    if args.dry_run:
        return dry_run(args, cases)
    dists = installed_dists()
    reason = skip_reason(dists)
    if reason:
        print(f"SKIP: {reason}", flush=True)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop the servers
    return run(args, cases, dists)


def run(args: argparse.Namespace, cases: list[Case], dists: dict[str, str]) -> int:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t_start = time.monotonic()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvferry-gpucheck-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log_config = workdir / "logging.json"
    log_config.write_text(json.dumps(logging_config(), indent=1))
    info = versions(dists)
    print(f"GPU check: {len(cases)} case(s); logs in {workdir}")
    print(
        f"  torch {torch.__version__} CUDA {torch.version.cuda}; "
        + ", ".join(f"{k} {v}" for k, v in info.items())
    )
    if warning := cuda_mismatch(torch.version.cuda, dists):
        print(f"  warn: {warning}")
    if any(c.attention == "FLASHINFER" for c in cases) and "flashinfer-python" not in dists:
        print("  warn: flashinfer-python is not installed: FLASHINFER cases will likely fail to start")
    if args.model:
        model, note = args.model, "given with --model"
    else:
        model, note = build_model(args.arch)
    print(f"  model {model} ({note}): {model_shape(model)}")
    launcher = args.launcher if args.launcher != "auto" else ("cli" if "vllm" in dists else "module")
    probe_env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.gpu}
    via = args.attention_via if args.attention_via != "auto" else detect_attention_via(launcher, probe_env)
    chooser = "--attention-backend" if via == "flag" else ATTENTION_ENV
    print(f"  launcher {launcher}; attention backend chosen by {chooser}")
    env = {"attention_via": via, "launcher": launcher, "log_config": log_config, "workdir": workdir}
    results: list[CaseResult] = []
    for members in groups(cases).values():
        results += run_group(members, model, args, env)
    print_summary(results)
    passed = all(r.ok for r in results)
    elapsed = time.monotonic() - t_start
    verdict = "PASSED" if passed else "FAILED"
    print(f"\nGPU check {verdict}: {sum(r.ok for r in results)}/{len(results)} cases ok in {elapsed:.0f} s")
    if args.out:
        report = {
            "ok": passed,
            "elapsed_s": elapsed,
            "environment": {
                **info,
                "torch": torch.__version__,
                "torch_cuda": torch.version.cuda,
                "launcher": launcher,
                "attention_via": via,
                "model": str(model),
                "model_note": note,
                "model_shape": model_shape(model),
            },
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cases": [{**asdict(r), "ok": r.ok} for r in results],
        }
        args.out.write_text(json.dumps(report, indent=2, default=str))
        print(f"results written to {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
