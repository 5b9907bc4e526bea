"""Leftovers of node agents that died without stopping: their network namespaces and cgroups.

An agent names its namespace `kvf-<node>-<pid>` and its cgroup `kvferry/<node>-<pid>`. When it is
killed (a test run stopped with SIGKILL, a crash), both stay, and so do the pod processes inside them.
A stale namespace keeps its veth, whose host side holds the node IP of the pod subnet: the next agent
for the same subnet then has its pod IPs routed into the dead namespace, and probes fail with no error
that names why. So an agent, before it sets up its own, removes every leftover whose owner pid is no
longer running: it kills the processes still inside (a namespace lives while a process is in it), then
deletes the namespace or cgroup. Leftovers of live agents (another test's, the demo's) are left alone.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from kvferry.local.nodeagent.cgroups import find_hierarchy, remove_dir, remove_pod_dir

NETNS_PREFIX = "kvf-"
IP_TIMEOUT_S = 10.0
KILL_WAIT_S = 5.0
_OWNER = re.compile(r"-(\d+)$")
log = logging.getLogger("kvferry.nodeagent")


def owner_pid(name: str) -> int | None:
    """The pid an agent put at the end of a namespace or cgroup name; None for names not of that form."""
    match = _OWNER.search(name)
    return int(match.group(1)) if match else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def stale(names: Iterable[str], alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """The names whose owner pid is not running (names without an owner pid are never stale)."""
    out = []
    for name in names:
        pid = owner_pid(name)
        if pid is not None and pid != os.getpid() and not alive(pid):
            out.append(name)
    return out


def reap(mounts_file: str = "/proc/self/mounts") -> list[str]:
    """Remove every dead agent's namespace and cgroup; returns what was removed (for the log)."""
    removed = [f"netns {name}" for name in _reap_namespaces()]
    removed += [f"cgroup {path}" for path in _reap_cgroups(mounts_file)]
    for what in removed:
        log.warning("removed the leftover %s of a node agent that is no longer running", what)
    return removed


def _ip(*args: str) -> str:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if res.returncode != 0:
        raise OSError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")
    return res.stdout


def _reap_namespaces() -> list[str]:
    try:
        listed = _ip("netns", "list")
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot list network namespaces to clean up: %s", exc)
        return []
    names = [line.split()[0] for line in listed.splitlines() if line.startswith(NETNS_PREFIX)]
    removed = []
    for name in stale(names):
        try:
            for pid in _ip("netns", "pids", name).split():
                _kill(int(pid))
            _ip("netns", "del", name)  # the last process gone, this also removes the veth pair
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            log.warning("cannot remove the leftover namespace %s: %s", name, exc)
            continue
        removed.append(name)
    return removed


def _reap_cgroups(mounts_file: str) -> list[Path]:
    try:
        hierarchy = find_hierarchy(Path(mounts_file).read_text())
    except OSError:
        return []
    base = hierarchy.root / "kvferry" if hierarchy else None
    if base is None or not base.is_dir():
        return []
    removed = []
    for name in stale(child.name for child in base.iterdir() if child.is_dir()):
        agent_dir = base / name
        for pod_dir in (p for p in agent_dir.iterdir() if p.is_dir()):
            remove_pod_dir(pod_dir)  # kills what is left in its containers, then removes them
        remove_dir(agent_dir)
        if not agent_dir.exists():
            removed.append(agent_dir)
    return removed


def _kill(pid: int) -> None:
    """SIGKILL, then wait (bounded) until the process has left: its namespaces go at exit."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.02)


def _running(pid: int) -> bool:
    """Alive and not yet a zombie (a zombie has already released its namespaces)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
