"""The contracts that say which folder runs where bite on the imports that matter, not only on the one
planted violation per contract of test_layering_contracts_catch_violations.py: the products never
import the build-time codegen, codegen and the dev-only tools and local import none of each other,
kopf stays in operator/runtime/ (and the autoscale timer), operator/fleet/ imports only the standard
library, and inject (now beside the connector) keeps the connector free of Kubernetes clients."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.unit.layering.test_layering_contracts_catch_violations import (
    CONFIG,
    NO_CACHES,
    PACKAGE_DIRS,
    ROOT,
    _plant,
)

# (contract id, importer, imported): each must be reported as an illegal import of that contract.
EDGES = [
    ("layers", "kvferry.operator.runtime.handlers", "kvferry.codegen.rbac"),
    ("layers", "kvferry.router.app", "kvferry.codegen.generate"),
    ("layers", "kvferry.connector.inject", "kvferry.codegen.crdgen"),
    ("layers", "kvferry.codegen.generate", "kvferry.tools.serve"),
    ("layers", "kvferry.tools.doctor.needs", "kvferry.codegen.crdgen"),
    ("layers", "kvferry.codegen.helm", "kvferry.local.tinymodel"),
    ("operator-kopf", "kvferry.operator.reconcile.steps", "kopf"),
    ("operator-kopf", "kvferry.operator.status.publish", "kopf"),
    ("fleet-stdlib", "kvferry.operator.fleet.coalesce", "kvferry.operator.spec.names"),
    ("engine-image", "kvferry.connector.inject", "kubernetes"),
]


def _section(stdout: str, name: str) -> str:
    """The part of lint-imports' report about the contract called `name` (up to the next contract)."""
    contracts = {c["name"] for c in CONFIG["tool"]["importlinter"]["contracts"]}
    body = stdout.split(f"\n{name}\n", 1)[-1]
    ends = [body.index(f"\n{other}\n") for other in contracts - {name} if f"\n{other}\n" in body]
    return body[: min(ends)] if ends else body


def test_each_planted_import_breaks_its_contract(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, tree / "kvferry" / folder, ignore=NO_CACHES)
    shutil.copy(ROOT / "pyproject.toml", tree)
    (tree / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "layering.py", tree / "tests")  # the stdlib_only contract type
    for _, importer, imported in EDGES:
        _plant(tree, importer, imported)
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache", "--no-logo"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode != 0, result.stdout
    names = {c["id"]: c["name"] for c in CONFIG["tool"]["importlinter"]["contracts"]}
    for contract, importer, imported in EDGES:
        assert f"{names[contract]} BROKEN" in result.stdout, (contract, result.stdout[-3000:])
        section = _section(result.stdout, names[contract])
        assert f"{importer} -> {imported} (l." in section, (contract, importer, imported, section[:3000])
