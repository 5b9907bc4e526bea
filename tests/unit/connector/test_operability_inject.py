"""`kvferry inject` and `kvferry preflight --startup`, run for real.

The copy is imported in a clean interpreter (-S -E: no site hooks, so not the editable install) whose
path is only the injected directory, the standard library and the venv's site-packages (vLLM, NIXL,
numpy: what a stock vLLM image provides). A stock image's too-old vLLM/NIXL is simulated by a shadow
directory ahead of site-packages; the start-up preflight must refuse it and write the termination log
the operator reads (operator/status/podchecks.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from kvferry.contracts import termination

TIMEOUT_S = 1200  # importing vLLM in a fresh interpreter: 20 s of CPU, ~7 min wall on the loaded host


def _kvferry() -> str:
    exe = shutil.which("kvferry")
    assert exe, "kvferry console script not on PATH (source scripts/env.sh)"
    return exe


def _clean_python(paths: list[Path], code: str) -> subprocess.CompletedProcess:
    """Run `code` in `python -S -E` with sys.path = paths + the stdlib (-S's own path) + site-packages."""
    site = sysconfig.get_paths()["purelib"]
    prelude = f"import sys; sys.path[:] = {[str(p) for p in paths]!r} + sys.path[1:] + [{site!r}]\n"
    return subprocess.run(
        [sys.executable, "-S", "-E", "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _startup_preflight(log: Path) -> str:
    """The pod's start-up step, as `python -m kvferry.connector.preflight` runs it."""
    argv = ["kvferry.connector.preflight", "--startup", "--backends", "UCX", "--termination-log", str(log)]
    return f"\nimport runpy; sys.argv = {argv!r}; runpy.run_module({argv[0]!r}, run_name='__main__')\n"


@pytest.fixture(scope="module")
def injected(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("inject")
    res = subprocess.run(
        [_kvferry(), "inject", "--to", str(dest)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "copied kvferry.connector" in res.stdout and "copied kvferry.contracts" in res.stdout
    return dest


def test_inject_copies_pure_python_only(injected: Path) -> None:
    assert not (injected / "kvferry" / "__init__.py").exists(), "kvferry must stay a namespace package"
    assert (injected / "kvferry" / "connector" / "connector.py").is_file()
    assert sorted(p.name for p in injected.iterdir()) == ["kvferry", "kvferry-inject.json"]  # nothing else
    compiled = [p for p in injected.rglob("*") if p.suffix in (".so", ".pyc")]
    assert compiled == [], f"compiled files would tie the copy to one Python ABI: {compiled}"


# One interpreter for both checks: importing vLLM takes minutes of wall time on the loaded 2-core host.
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_injected_connector_imports_and_passes_startup_preflight(injected: Path, tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    code = """
import kvferry.connector, msgspec
from kvferry.connector.connector import KvferryConnector
from kvferry.connector import wire
print("FILES", kvferry.connector.__file__, msgspec.__file__, KvferryConnector.__mro__[1].__module__)
"""
    res = _clean_python([injected], code + _startup_preflight(log))
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    files = next(line for line in res.stdout.splitlines() if line.startswith("FILES "))
    conn_file, msgspec_file, base_module = files.split()[1:]
    assert conn_file.startswith(str(injected)), conn_file
    assert msgspec_file.startswith(sysconfig.get_paths()["purelib"]), msgspec_file  # vLLM's own msgspec
    assert base_module.startswith("vllm."), base_module
    for check in ("vllm_version", "nixl_version", "vllm_glue", "backend_UCX"):
        assert f"ok   {check}" in res.stdout, res.stdout
    assert not log.exists()


def _shadow(tmp_path: Path, vllm: str | None = None, nixl: str | None = None) -> Path:
    """A directory that makes the interpreter see another vLLM and/or NIXL version first."""
    shadow = tmp_path / "image"
    if vllm:
        (shadow / "vllm").mkdir(parents=True)
        (shadow / "vllm" / "__init__.py").write_text(f"__version__ = {vllm!r}\n")
    if nixl:
        meta = shadow / f"nixl-{nixl}.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nixl\nVersion: {nixl}\n")
    return shadow


@pytest.mark.parametrize(
    ("vllm", "nixl", "check", "text"),
    [
        ("0.26.0", None, "vllm_version", "vLLM 0.26.0 is older than 0.32"),
        # The shadow vLLM keeps this case from importing the real one (slow on a loaded host).
        ("0.32.0", "1.4.2", "nixl_version", "NIXL 1.4.2 is older than 1.5"),
    ],
)
def test_startup_preflight_refuses_an_old_image(injected, tmp_path, vllm, nixl, check, text) -> None:
    log = tmp_path / "termination-log"
    res = _clean_python([injected, _shadow(tmp_path, vllm, nixl)], _startup_preflight(log))
    assert res.returncode == 1, res.stdout + res.stderr[-2000:]
    assert f"FAIL {check}" in res.stdout
    message = log.read_text()
    assert message.startswith(termination.PREFLIGHT_FAILED), message
    assert f"{check}: " in message and text in message, message


def test_inject_failure_names_the_problem(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log = tmp_path / "termination-log"
    res = subprocess.run(
        [_kvferry(), "inject", "--to", str(blocker), "--termination-log", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert log.read_text().startswith(termination.INJECT_FAILED) and str(blocker) in log.read_text()
