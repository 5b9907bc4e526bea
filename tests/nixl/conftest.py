"""NIXL process tests: real NIXL agents (UCX, DRAM) in separate processes, stopped by PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.nixl.helpers import Procs


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        for proc in p.all:
            proc.stop()
