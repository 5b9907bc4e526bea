"""Shared e2e fixtures: the tiny model and the single-instance reference outputs (computed once)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from kvferry.connector.plugins.cpu_isa import ENV_NO_AMX
from kvferry.local.amxprobe import amx_kernel_runs
from kvferry.local.tinymodel import ensure
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

from .pdclient import outputs, reference_gaps


@pytest.fixture(scope="session", autouse=True)
def vllm_off_a_broken_amx_kernel() -> None:
    """Hosts whose advertised AMX cannot run vLLM's amx attention kernel (SIGILL) serve bf16 with its
    vec kernel instead (connector/plugins/cpu_isa.py); every vLLM these tests start inherits it."""
    if os.environ.get(ENV_NO_AMX) is None and not amx_kernel_runs():
        os.environ[ENV_NO_AMX] = "1"
        print(f"\nthis host cannot run vLLM's AMX attention kernel (SIGILL): {ENV_NO_AMX}=1 from here on")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure("llama")


@pytest.fixture(scope="session")
def single_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One plain vLLM instance: its greedy outputs and their top-2 logprob gaps; stopped before any
    P/D pair starts (memory)."""
    log = tmp_path_factory.mktemp("single") / "single.log"
    spec = ServerSpec(model=tiny_model, port=free_port(), cores="0-1")
    with VllmProcess(spec, log) as single:
        return {"outputs": outputs(single.url), "gaps": reference_gaps(single.url)}


@pytest.fixture(scope="session")
def reference(single_run: dict[str, Any]) -> dict[str, Any]:
    return single_run["outputs"]


@pytest.fixture(scope="session")
def gaps(single_run: dict[str, Any]) -> dict[str, list[float]]:
    return single_run["gaps"]
