"""The built wheel holds every module and data file of the product folders, under its kvferry.* name.

Every test but the wheel tier (tests/wheel) runs the editable checkout, which finds any file in any
folder; a non-editable install (the images, `pip install kvferry-*.whl`) has only what the wheel holds.
A package left out of the wheel (kvferry.operator.spec once was) fails here, with its files named.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import tomllib

from tests.wheel import wheelkit

PRODUCT = {"connector", "operator", "router", "contracts", "tools", "codegen", "local", "cli"}
DOCS = {".md"}  # a folder's README is for readers of the repository, not for the installed package


@pytest.fixture(scope="module")
def wheel_names() -> set[str]:
    with zipfile.ZipFile(wheelkit.built_wheel()) as whl:
        return set(whl.namelist())


def expected_files() -> dict[str, Path]:
    """{path in the wheel: source file} for every module and data file of every portion."""
    out = {}
    for portion, folder in wheelkit.portions().items():
        base = Path(*portion.split("."))
        for rel in wheelkit.source_files():
            if rel.parts[0] == folder and rel.suffix not in DOCS:
                out[str(base / rel.relative_to(folder))] = rel
    return out


def test_the_product_folders_are_the_package_portions() -> None:
    assert set(wheelkit.portions().values()) == PRODUCT


def test_every_module_and_data_file_is_in_the_wheel(wheel_names: set[str]) -> None:
    expected = expected_files()
    # The class, not one list: modules of folders without an __init__.py and data folders count too.
    assert "kvferry/operator/spec/__init__.py" in expected
    assert "kvferry/local/nodeagent/podnet/sitecustomize.py" in expected
    assert "kvferry/operator/render/templates/statefulset.yaml.j2" in expected
    missing = sorted(f"{name} (from {src})" for name, src in expected.items() if name not in wheel_names)
    assert not missing, f"{len(missing)} files not in the wheel:\n" + "\n".join(missing)


def test_the_wheel_holds_nothing_else(wheel_names: set[str]) -> None:
    stray = sorted(n for n in wheel_names if not n.startswith("kvferry-") and n not in expected_files())
    assert not stray, stray
    assert "kvferry/__init__.py" not in wheel_names, "kvferry is a namespace package: no top-level __init__"


def test_the_wheel_declares_the_command_and_the_vllm_plugins(wheel_names: set[str]) -> None:
    (entry_points,) = [n for n in wheel_names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(wheelkit.built_wheel()) as whl:
        text = whl.read(entry_points).decode()
    config = tomllib.loads((wheelkit.ROOT / "pyproject.toml").read_text())["project"]
    assert f"kvferry = {config['scripts']['kvferry']}" in text
    for name, target in config["entry-points"]["vllm.general_plugins"].items():
        assert f"{name} = {target}" in text
