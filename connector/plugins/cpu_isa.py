"""CPU ISA step: keep vLLM off its AMX attention kernel on hosts where that kernel cannot run.

vLLM's CPU attention picks its `amx` kernel for bf16 KV in blocks of a multiple of 32 tokens whenever
`torch.cpu._is_amx_tile_supported()` says so. On some virtual machines that kernel dies with SIGILL on
the first forward (seen 2026-12-03 on a Xeon VM advertising amx_bf16 and amx_tile with tile permission
granted: plain vLLM, no connector, exit 132), so the worker exits and every request fails. With
KVFERRY_CPU_NO_AMX=1 this plugin makes vLLM see no AMX, so it takes its `vec` kernel. The connector
reads the KV layout from the same backend choice, so what it moves follows. `local/amxprobe.py` tells
whether a host needs it.

Loaded in every vLLM process through vLLM's `vllm.general_plugins` entry point; without the env var
it does nothing.
"""

from __future__ import annotations

import os

ENV_NO_AMX = "KVFERRY_CPU_NO_AMX"


def register() -> None:
    """vLLM general-plugin hook; runs once per vLLM process."""
    if os.environ.get(ENV_NO_AMX) != "1":
        return
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False  # vLLM asks at kernel selection, per call
