"""What the images run, from the built wheel installed non-editable: the operator image's modules import
from the installed package, `kvferry inject` copies a payload a vLLM environment loads the connector
from, and each image's prune step (images/prune.py, with its Dockerfile's arguments) leaves an
installation whose commands still import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvferry.contracts import pods

from tests.unit.images.test_dockerfiles_follow_the_image_rules import prune_args
from tests.wheel import wheelkit

ROOT = wheelkit.ROOT

# Imports every module under the named packages and prints where each came from (one per line). Run
# with -I: neither PYTHONPATH, the user's site nor the working directory reach sys.path.
_IMPORT_ALL = """
import importlib, pkgutil, sys
for name in sys.argv[1:]:
    mod = importlib.import_module(name)
    print(name, mod.__file__)
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), name + "."):
        if info.name.endswith(".__main__"):  # runs the command
            continue
        print(info.name, importlib.import_module(info.name).__file__)
"""


def _run(python: Path, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout_s: float = 180):
    return subprocess.run(
        [str(python), *args],
        cwd=cwd,
        env=env or wheelkit.clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _operator_image_imports() -> list[str]:
    """What the operator image imports: its kept packages but the inject payload (copied, never run)."""
    keep, _ = prune_args("operator")
    payload = {"kvferry.connector"}
    return [k for k in keep if k not in payload]


def test_the_install_is_the_wheel_not_the_checkout(wheel_venv, tmp_path: Path) -> None:
    site = wheel_venv.site
    assert (site / "kvferry" / "operator" / "spec" / "__init__.py").is_file()
    assert not list(site.glob("__editable__*")), "an editable install, not the wheel"
    proc = _run(wheel_venv.python, "-I", "-c", _IMPORT_ALL, *_operator_image_imports(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert "kvferry.operator.spec" in where and "kvferry.operator.autoscale" in where
    outside = {name: path for name, path in where.items() if not path.startswith(f"{site}/kvferry/")}
    assert not outside, outside


def test_inject_from_the_wheel_gives_a_payload_vllm_loads_the_connector_from(
    wheel_venv, tmp_path: Path
) -> None:
    dest = tmp_path / "payload"
    proc = _run(wheel_venv.kvferry, "inject", "--to", str(dest), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (dest / "kvferry-inject.json").is_file()
    # The stock vLLM image's side: the dev venv's vLLM, NIXL and torch, kvferry only from the payload
    # (-S: no .pth files, so the checkout's editable finder is not installed; -P: no working directory).
    env = {**wheelkit.clean_env(), "PYTHONPATH": f"{dest}:{wheelkit.dev_site_packages()}"}
    code = (
        "import importlib, sys; "
        f"cls = getattr(importlib.import_module({pods.CONNECTOR_MODULE!r}), {pods.CONNECTOR_CLASS!r}); "
        "print(cls.__module__); "
        "print('\\n'.join(m.__file__ for n, m in sys.modules.items() "
        "if n.startswith('kvferry.') and getattr(m, '__file__', None)))"
    )
    loaded = _run(Path(sys.executable), "-S", "-P", "-c", code, cwd=dest, env=env, timeout_s=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    lines = loaded.stdout.splitlines()
    assert lines[0] == f"{pods.CONNECTOR_MODULE}.connector"
    assert len(lines) > 5 and all(path.startswith(f"{dest}/kvferry/") for path in lines[1:]), lines


def test_operator_image_prune_on_the_installed_wheel_keeps_its_commands(wheel_venv, tmp_path: Path) -> None:
    """images/operator/Dockerfile's build step on a fresh install of the wheel: install, prune, inject."""
    keep, commands = prune_args("operator")
    venv = tmp_path / "venv"
    python = wheelkit.install(venv, wheel_venv.wheel, "operator,router")
    env = wheelkit.clean_env(venv)
    prune = [str(ROOT / "images" / "prune.py"), "--keep", *keep, "--commands", *commands]
    proc = _run(python, *prune, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    root = wheelkit.site_packages(python) / "kvferry"
    assert not (root / "local").exists()
    assert (root / "operator" / "spec").is_dir() and (root / "operator" / "render" / "templates").is_dir()
    kvferry = venv / "bin" / "kvferry"
    done = _run(kvferry, "inject", "--to", str(tmp_path / "inject-check"), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    for command in commands:
        helped = _run(kvferry, command, "--help", cwd=tmp_path, env=env)
        assert helped.returncode == 0, f"kvferry {command} --help: {helped.stderr[-2000:]}"
    gone = _run(kvferry, "demo", cwd=tmp_path, env=env)
    assert gone.returncode == 2 and "kvferry demo: not in this installation" in gone.stderr, gone.stderr


def test_engine_image_prune_on_the_installed_wheel_keeps_preflight(wheel_venv, tmp_path: Path) -> None:
    """images/vllm/Dockerfile's build step: the wheel installed over a vLLM environment (the dev venv's
    packages stand in for the image's, through a .pth file), pruned, then its own import check."""
    keep, commands = prune_args("vllm")
    venv = tmp_path / "venv"
    python = wheelkit.install(venv, wheel_venv.wheel, no_deps=True)  # the image has the connector's deps
    site = wheelkit.site_packages(python)
    (site / "vllm-image.pth").write_text(f"{wheelkit.dev_site_packages()}\n")
    env = wheelkit.clean_env(venv)
    prune = [str(ROOT / "images" / "prune.py"), "--keep", *keep, "--commands", *commands]
    proc = _run(python, *prune, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (site / "kvferry").iterdir() if p.name != "__pycache__") == [
        "cli",
        "connector",
        "contracts",
    ]
    code = "import kvferry.connector, nixl; print(kvferry.connector.__file__)"  # the Dockerfile's check
    check = _run(python, "-c", code, cwd=tmp_path, env=env)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.strip().startswith(f"{site}/kvferry/connector/")
