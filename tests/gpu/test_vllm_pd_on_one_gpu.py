"""The GPU tier (`-m gpu`): `kvferry gpu-check-vllm --quick` on one CUDA GPU. P and D vLLM servers with
KvferryConnector on the same device answer greedy requests token for token as a single vLLM does, with
the KV moved over NIXL from VRAM (decode's /metrics count every transfer, no failure). Skipped, with the
check's own reason, where CUDA, a CUDA vLLM or a CUDA NIXL is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvferry.tools.gpucheck.vllmpd.probe import skip_reason

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]


def test_pd_on_one_gpu_answers_as_a_single_vllm(tmp_path: Path) -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "gpu-check.json"
    cmd = [sys.executable, "-m", "kvferry.cli", "gpu-check-vllm", "--quick", "--enforce-eager"]
    cmd += ["--out", str(out), "--workdir", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["cases"]) == 1, report
    case = report["cases"][0]
    assert case["ok"] and case["total"] > 0 and case["equal"] + case["ties"] == case["total"], case
    stats = case["sequential"]
    assert stats["kv_bytes"] > 0 and stats["consumer_transfers"] == case["total"], stats
    assert not stats["failures"], stats
