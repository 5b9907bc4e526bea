"""Run or SKIP: what is installed (read from package metadata, nothing imported), whether torch sees
a CUDA device, the versions and GPUs to report, and how the installed vLLM takes its backend."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping
from typing import Any

from .command import help_command


def installed_dists() -> dict[str, str]:
    """Installed distributions, lower-case name -> version (no package is imported)."""
    out: dict[str, str] = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name:
            out.setdefault(name, dist.version)
    return out


def _cuda_nixl(dists: Mapping[str, str]) -> list[str]:
    return sorted(n for n in dists if re.fullmatch(r"nixl-cu\d+", n))


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
    if not _cuda_nixl(dists):
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
    majors = [n.removeprefix("nixl-cu") for n in _cuda_nixl(dists)]
    want = (torch_cuda or "").split(".")[0]
    if want and majors and want not in majors:
        return f"torch is built for CUDA {torch_cuda}, NIXL for CUDA {', '.join(majors)}"
    return None


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


def versions(dists: Mapping[str, str]) -> dict[str, Any]:
    """The stack's versions and, when nvidia-smi is there, the GPUs."""
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
