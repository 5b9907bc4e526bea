"""How one vLLM server on the GPU is launched: its spec, command line, environment, logging config."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.tools.pdclient import DEADLINE_S, HOST, SERVED_NAME
from kvferry.tools.serve import KVFERRY_CONNECTOR, SERVER_MODULE, ServerSpec, kv_transfer_config

CLI_MODULE = "vllm.entrypoints.cli.main"  # `vllm serve`, without needing the console script on PATH
ATTENTION_ENV = "VLLM_ATTENTION_BACKEND"  # how older vLLM releases pick the backend
KV_LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"
CPU_ONLY_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
LAUNCHER_MODULES = {"cli": (CLI_MODULE, "serve"), "module": (SERVER_MODULE,)}


@dataclass(frozen=True)
class GpuServerSpec:
    """One vLLM server on the GPU: role in the pair, attention backend, KV dtype, block size and (P/D)
    the KV buffer device of its kv-transfer-config."""

    model: Path
    port: int
    role: str  # single | prefill | decode
    attention: str
    kv_dtype: str
    block_size: int
    kv_buffer_device: str = "cuda"  # cpu: the connector stages the GPU cache through host twins
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
    """serve.py's --kv-transfer-config for the role, with the spec's KV buffer device (cuda: NIXL
    registers the GPU cache itself; cpu: host twins of it, copied device<->host per block)."""
    config = kv_transfer_config(spec.server_spec())
    if config is not None:
        config["kv_buffer_device"] = spec.kv_buffer_device
    return config


def _launcher(kind: str, python: str) -> list[str]:
    if kind not in LAUNCHER_MODULES:
        raise ValueError(f"launcher {kind!r} is not cli or module")
    return [python, "-m", *LAUNCHER_MODULES[kind]]


def launcher_prefix(kind: str, python: str = sys.executable) -> list[str]:
    """Everything before the model path."""
    return _launcher(kind, python) + (["--model"] if kind == "module" else [])


def help_command(kind: str, python: str = sys.executable, all_groups: bool = False) -> list[str]:
    return [*_launcher(kind, python), "--help=all" if all_groups else "--help"]


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
