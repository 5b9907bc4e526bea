"""NIXL process tests: real NIXL agents (UCX, DRAM) in separate processes, stopped by PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.nixl.helpers import ProcPool, Procs


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        for proc in p.all:
            proc.stop()


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcPool]:
    p = ProcPool()
    try:
        yield p
    finally:
        for proc in p.all:
            proc.stop()


@pytest.fixture
def pooled(pool: ProcPool) -> Iterator[ProcPool]:
    """Processes from the module's pool; all of them are free again after the test."""
    try:
        yield pool
    finally:
        pool.release()
