"""Components built on demand (build.ON_DEMAND: Kueue) for the tests that need them, without adding their
cold build to a cold run's critical path.

Kueue's cold Go build is ~15 min on 2 cores. Built in the foreground it would sit in front of every
test; here it starts in the background at `nice 19` once the always-built components are ready, the
tests that need it are collected last, and their fixture waits (bounded) for it. A warm run finds the
stamp and starts nothing. The process is stopped at session end if it is still running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvferry.local.controlplane import build

# Markers whose tests need build.ON_DEMAND; those tests run last so the background build has the most time.
ON_DEMAND_MARKERS = ("kueue",)
# The longest a test waits for the build it needs: a cold Kueue build alone took 876 s on a loaded host.
BUILD_WAIT_S = 40 * 60.0
_BUILD_CMD = (
    "from kvferry.local.controlplane.cli import main; raise SystemExit(main(['build', '--with', 'kueue']))"
)


class _Background:
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None


def needs_on_demand(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) for m in ON_DEMAND_MARKERS)


def last(items: list[pytest.Item]) -> None:
    """Move the tests that need an on-demand component to the end (stable otherwise)."""
    items[:] = [i for i in items if not needs_on_demand(i)] + [i for i in items if needs_on_demand(i)]


def start_if_missing() -> None:
    """Start `kvferry cluster build --with kueue` in the background, niced, if anything is missing."""
    if not build.missing(build.ON_DEMAND) or _Background.proc is not None:
        return
    build.share_dir().mkdir(parents=True, exist_ok=True)
    log = build.share_dir() / "build-on-demand.out"
    with log.open("wb") as out:
        _Background.proc = subprocess.Popen(
            [sys.executable, "-c", _BUILD_CMD],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.nice(19),  # tests first: the build takes what they leave idle
        )
    _Background.log = log
    print(f"[on-demand build] Kueue building in the background (log: {log})", flush=True)


def wait_built(timeout_s: float = BUILD_WAIT_S) -> None:
    """Return once build.ON_DEMAND is built; fail naming the log if the build failed or ran past the bound."""
    proc = _Background.proc
    if proc is not None:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the on-demand build ran past {timeout_s:.0f} s; its log: {_Background.log}")
        if proc.returncode != 0:
            pytest.fail(f"the on-demand build failed (exit {proc.returncode}); its log: {_Background.log}")
    # Not started here (another session built it meanwhile, or it was missing at collection): foreground.
    t0 = time.monotonic()
    build.ensure_built(extra=build.ON_DEMAND)
    if build.missing(build.ON_DEMAND):
        pytest.fail(f"{[c.name for c in build.missing(build.ON_DEMAND)]} still missing after the build")
    if time.monotonic() - t0 > 1:
        print(f"[on-demand build] built in the foreground in {time.monotonic() - t0:.0f} s", flush=True)


def stop() -> None:
    proc = _Background.proc
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
