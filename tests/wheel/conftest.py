"""The wheel tier: kvferry run from its built wheel, installed non-editable into a clean venv, the way
the images and a user's `pip install kvferry-*.whl` get it (every other tier runs the editable
checkout, which finds files the wheel may lack). All tests here are marked `wheel`; those that need the
local control plane are marked `cluster` too, so its binaries are built first (tests/cluster/conftest.py).

`wheel_venv`: the cached venv with the current wheel and the operator image's extras (wheelkit.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.wheel import wheelkit

_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selection reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.wheel)


@dataclass(frozen=True)
class WheelVenv:
    venv: Path
    wheel: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def kvferry(self) -> Path:
        return self.venv / "bin" / "kvferry"

    @property
    def site(self) -> Path:
        return wheelkit.site_packages(self.python)


@pytest.fixture(scope="session")
def wheel_venv() -> WheelVenv:
    venv = wheelkit.clean_venv("operator,router")
    return WheelVenv(venv, wheelkit.built_wheel())
