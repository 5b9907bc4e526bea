"""Packages found, not listed: every folder under each package-dir portion of pyproject.toml.

kvferry is a namespace package whose portions live in separate folders (connector/ is kvferry.connector,
...), which `[tool.setuptools.packages.find]` cannot express: it names packages after their folder, not
after the portion they map to. So this finds the subpackages of each portion (folders with or without an
__init__.py: data folders such as render/templates count too, so their files ship as package data) and
prefixes them with the portion's name. Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # build-system requires tomli there
    import tomli as tomllib

HERE = Path(__file__).resolve().parent


def found_packages() -> list[str]:
    portions = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = []
    for portion, folder in portions.items():
        out.append(portion)
        subpackages = find_namespace_packages(str(HERE / folder), exclude=["__pycache__", "*.__pycache__"])
        out += [f"{portion}.{sub}" for sub in subpackages]
    return sorted(out)


setup(packages=found_packages())
