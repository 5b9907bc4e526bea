"""The layering rules of docs/architecture.md bite: every import-linter contract in pyproject.toml breaks
on a copy of the tree with one violation planted for it, and vLLM's attention backends are read in the
two places the architecture names."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[3]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = CONFIG["tool"]["setuptools"]["package-dir"]
NO_CACHES = shutil.ignore_patterns("__pycache__")


def _file(tree: Path, module: str) -> Path:
    """The source file of `module` (a kvferry namespace portion's module or package) in a copied tree."""
    for package, folder in PACKAGE_DIRS.items():
        if module == package or module.startswith(package + "."):
            base = tree / "kvferry" / folder / Path(*module[len(package) + 1 :].split("."))
            return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    raise AssertionError(f"{module} is in no package-dir portion")


def _plant(tree: Path, importer: str, imported: str) -> None:
    # Imported lazily inside a function: import-linter must count those as well.
    with _file(tree, importer).open("a") as out:
        out.write(f"\n\ndef _layering_probe() -> None:\n    import {imported}  # noqa\n")


def _violation(contract: dict) -> tuple[str, str]:
    """(importer, imported) that breaks `contract`."""
    kind = contract["type"]
    if kind == "forbidden":
        return contract["source_modules"][0], contract["forbidden_modules"][0]
    if kind == "protected":
        return "kvferry.router", contract["protected_modules"][0]
    if kind == "independence":
        return contract["modules"][0], contract["modules"][1]
    if kind == "layers":
        lowest, highest = contract["layers"][-1], contract["layers"][0]
        return lowest.split(" ")[0], highest.split(" ")[0]
    if kind == "stdlib_only":
        return contract["modules"][0], "yaml"
    raise AssertionError(f"no planted violation for contract type {kind}: add one here")


def _copy(tmp_path: Path) -> Path:
    """A copy of every portion, pyproject.toml and the stdlib_only contract type, to plant into."""
    tree = tmp_path / "tree"
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, tree / "kvferry" / folder, ignore=NO_CACHES)
    shutil.copy(ROOT / "pyproject.toml", tree)
    (tree / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "layering.py", tree / "tests")
    return tree


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    # The copy's kvferry (a namespace on PYTHONPATH) is found before the editable install's finder.
    return subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache", "--no-logo"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_contract_breaks_on_its_planted_violation(tmp_path: Path) -> None:
    contracts = CONFIG["tool"]["importlinter"]["contracts"]
    tree = _copy(tmp_path)
    for contract in contracts:
        _plant(tree, *_violation(contract))
    result = _lint(tree)
    assert result.returncode != 0, result.stdout
    for contract in contracts:
        assert f"{contract['name']} BROKEN" in result.stdout, (contract["id"], result.stdout[-3000:])


def test_the_pd_client_may_import_contracts_but_no_other_kvferry_module(tmp_path: Path) -> None:
    # stdlib_only's allowed_modules: pdclient's own import of kvferry.contracts.params is kept, a
    # sibling tool (serve.py: httpx, processes) is not.
    (contract,) = [c for c in CONFIG["tool"]["importlinter"]["contracts"] if c["id"] == "pdclient-pure"]
    tree = _copy(tmp_path)
    _plant(tree, "kvferry.tools.pdclient", "kvferry.tools.serve")
    result = _lint(tree)
    assert f"{contract['name']} BROKEN" in result.stdout, result.stdout[-3000:]
    broken = result.stdout.split(f"{contract['name']}\n", 1)[-1]
    assert "- kvferry.tools.pdclient -> kvferry.tools.serve" in broken, broken[:3000]
    assert "-> kvferry.contracts" not in broken, broken[:3000]


ATTENTION_ATTRS = {"attn_backend", "get_attn_backend", "do_kv_cache_update"}
ATTENTION_READERS = {ROOT / "connector" / "kvcache.py", ROOT / "tools" / "vllmkv.py"}


def _reads_attention_backends(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ATTENTION_ATTRS:
            lines.append(node.lineno)
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if any(n.startswith("vllm.") and ".attention.backends" in n for n in names):
            lines.append(node.lineno)
    return lines


def test_only_kvcache_and_vllmkv_read_vllm_attention_backends() -> None:
    # Not an import rule (kvcache reaches the backend through the layer object), so not import-linter's.
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for folder in PACKAGE_DIRS.values()
        for path in (ROOT / folder).rglob("*.py")
        if path not in ATTENTION_READERS
        for line in _reads_attention_backends(path)
    }
    assert not found, f"vLLM attention backends read outside kvcache.py and tools/vllmkv.py: {sorted(found)}"
    assert all(_reads_attention_backends(p) for p in ATTENTION_READERS), "the rule no longer matches the code"
