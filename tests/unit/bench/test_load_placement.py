"""--load-on: the P/D benches' client and router run on the cores asked for, and a bench's own
process gets its cores back afterwards (tools/pdstack.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvferry.tools.pdstack import LOAD_ON, PdStack
from kvferry.tools.serve import _descendants, pin_tree

from tests.waiting import wait_until

SLEEPER = "import time; time.sleep(30)"
PARENT = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); {SLEEPER}"


def stack(load_cores: str) -> PdStack:
    return PdStack("kvferry", Path("/nonexistent"), Path("/nonexistent"), load_cores=load_cores)


def test_the_client_runs_on_the_load_cores_and_the_bench_gets_its_cores_back():
    before = os.sched_getaffinity(0)
    core = min(before)
    with stack(str(core)).client_here():
        assert os.sched_getaffinity(0) == {core}
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert child.stdout.strip() == str([core])  # vllm bench serve inherits them
    assert os.sched_getaffinity(0) == before


def test_anywhere_leaves_the_client_where_it_was():
    before = os.sched_getaffinity(0)
    with stack(LOAD_ON["anywhere"]).client_here():
        assert os.sched_getaffinity(0) == before


def test_pin_tree_moves_a_process_and_its_children():
    cores = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        wait_until(lambda: _descendants(proc.pid), "the child process", 10, 0.05)
        assert pin_tree(proc.pid, {cores[-1]}) >= 2
        for pid in [proc.pid, *_descendants(proc.pid)]:
            assert os.sched_getaffinity(pid) == {cores[-1]}
    finally:
        for pid in [*_descendants(proc.pid), proc.pid]:
            os.kill(pid, 9)
        proc.wait(10)
