"""The built wheel and clean environments installed from it, cached per source hash outside the repo.

`built_wheel()` builds kvferry's wheel with `uv build` from a staged copy of exactly what the build reads
(pyproject.toml, setup.py, README.md and the package-dir folders, as the images' build context), so the
checkout gets no build/ or egg-info and a stray file outside those folders cannot leak in. `clean_venv()`
installs that wheel, non-editable, with extras, into a fresh venv (dependencies from uv's cache or the
index). Both live under $KVFERRY_CACHE/wheel/<hash>/ and are rebuilt only when a source file changes.
Offline, UV_OFFLINE=1 (passed through to uv) builds and installs from uv's cache alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVFERRY_CACHE", Path.home() / ".cache" / "kvferry")) / "wheel"
BUILD_FILES = ("pyproject.toml", "setup.py", "README.md")
PYTHON = "3.11"  # the images' Python (images/*/Dockerfile)
KEEP_BUILDS = 3  # older source hashes are deleted
BUILD_TIMEOUT_S = 300.0
INSTALL_TIMEOUT_S = 600.0  # cold: the operator extras' dependencies from the index


class WheelKitError(RuntimeError):
    """A build or install step failed; the message holds its output."""


def portions(root: Path | None = None) -> dict[str, str]:
    """pyproject's package-dir: {"kvferry.connector": "connector", ...}."""
    config = tomllib.loads(((root or ROOT) / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"]["package-dir"])


def source_files(root: Path | None = None) -> list[Path]:
    """What the build reads, relative to `root` (the checkout): the build files and every file of the
    package folders but bytecode."""
    root = root or ROOT
    files = [Path(name) for name in BUILD_FILES if (root / name).is_file()]
    for folder in portions(root).values():
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append(path.relative_to(root))
    return files


def source_hash(root: Path | None = None) -> str:
    root = root or ROOT
    digest = hashlib.sha256()
    for rel in source_files(root):
        digest.update(str(rel).encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _uv() -> str:
    uv = shutil.which("uv")
    if not uv:
        raise WheelKitError("uv not found on PATH (scripts/setup.sh installs it)")
    return uv


def _run(argv: list[str], what: str, timeout_s: float, cwd: Path | None = None) -> None:
    proc = subprocess.run(
        argv, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        command = " ".join(argv)
        raise WheelKitError(f"{what} failed ({proc.returncode}): {command}\n{proc.stdout}{proc.stderr}")


def clean_env(venv: Path | None = None) -> dict[str, str]:
    """This environment without what would point a Python at the checkout or the dev venv; with
    `venv`, its bin/ first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv)
    return env


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One builder at a time across processes (two pytest runs, a pytest-xdist worker)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_wheel(root: Path, out: Path) -> Path:
    """Build the wheel of the project at `root` into `out` from a staged copy of its build inputs."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix="stage-") as tmp:
        stage = Path(tmp)
        for rel in source_files(root):
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, stage / rel)
        _run(
            [_uv(), "build", "-q", "--wheel", "-p", PYTHON, "-o", str(out), str(stage)],
            "uv build --wheel",
            BUILD_TIMEOUT_S,
        )
    (wheel,) = out.glob("kvferry-*.whl")
    return wheel


def _prune_old(keep: str) -> None:
    entries = sorted((p for p in CACHE.iterdir() if p.is_dir() and p.name != keep), key=os.path.getmtime)
    for old in entries[: max(0, len(entries) - (KEEP_BUILDS - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def built_wheel() -> Path:
    """The wheel of the checkout as it is now (built once per source hash)."""
    key = source_hash()
    home = CACHE / key
    with _locked():
        found = sorted((home / "dist").glob("kvferry-*.whl")) if home.is_dir() else []
        if found:
            os.utime(home)
            return found[0]
        tmp = CACHE / f".{key}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build_wheel(ROOT, tmp / "dist")
        shutil.rmtree(home, ignore_errors=True)
        tmp.rename(home)
        _prune_old(key)
        return next((home / "dist").glob("kvferry-*.whl"))


def install(venv: Path, wheel: Path, extras: str = "", *, no_deps: bool = False) -> Path:
    """A new venv at `venv` with `wheel` installed non-editable (with `extras`); returns its python."""
    uv = _uv()
    _run([uv, "venv", "-q", "-p", PYTHON, str(venv)], "uv venv", 120.0)
    python = venv / "bin" / "python"
    spec = f"{wheel}[{extras}]" if extras else str(wheel)
    argv = [uv, "pip", "install", "-q", "--python", str(python), spec]
    _run(argv + (["--no-deps"] if no_deps else []), f"uv pip install {wheel.name}", INSTALL_TIMEOUT_S)
    return python


def clean_venv(extras: str = "operator,router") -> Path:
    """A cached venv with the current wheel and `extras` installed; returns the venv folder."""
    wheel = built_wheel()
    venv = wheel.parent.parent / f"venv-{extras.replace(',', '-') or 'bare'}"
    with _locked():
        if not (venv / ".complete").is_file():
            shutil.rmtree(venv, ignore_errors=True)
            install(venv, wheel, extras)
            (venv / ".complete").write_text(wheel.name + "\n")
    return venv


def site_packages(python: Path) -> Path:
    """purelib of the venv that `python` belongs to."""
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=clean_env(),
    )
    return Path(out.stdout.strip())


def dev_site_packages() -> Path:
    """The dev venv's purelib (vLLM, NIXL, torch): stands in for a vLLM image's packages."""
    return Path(sysconfig.get_paths()["purelib"])
