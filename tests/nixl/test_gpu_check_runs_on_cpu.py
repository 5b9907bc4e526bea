"""`kvferry gpu-check --device cpu` end to end: DRAM caches in the CUDA page orders move between
rank processes through the connector over real NIXL (VRAM pass and staged pass), every case equal,
with vLLM made unimportable in the parent and every rank process (the check needs torch and NIXL
only). A quick subset: TP 1->2 staged fp8, TP 2->1 fp16, TP 1->1 bf16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl


def blocked_vllm(tmp: Path) -> dict[str, str]:
    pkg = tmp / "blocked" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('vllm is blocked: the GPU check must not need it')\n")
    path = [str(tmp / "blocked"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def test_gpu_check_on_cpu_moves_every_case_exactly_without_vllm(tmp_path):
    cmd = [sys.executable, "-m", "kvferry.tools.gpucheck", "--device", "cpu", "--quick", "--max-cases", "3"]
    out = subprocess.run(
        cmd, cwd=tmp_path, env=blocked_vllm(tmp_path), capture_output=True, text=True, timeout=400
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("ok", "FAIL"))]
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert len(lines) == 3 and all(ln.startswith("ok ") for ln in lines), out.stdout
    assert "staged" in lines[1] and "tp1 -> " in lines[1] and "tp2 float8_e4m3fn" in lines[1]
    assert all("mismatches=0" in ln and "received=" in ln and "raw=" in ln for ln in lines)
    assert "gpu-check: 3/3 cases equal, 0 failed" in out.stdout


def test_gpu_check_refuses_a_missing_gpu_by_name(tmp_path):
    env = {**blocked_vllm(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "gpu-check"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and "--device cpu" in out.stderr
