"""local/nodeagent/reaper.py: a killed agent's namespace and cgroup, and the pod processes still in
them, are removed by the next agent; a live agent's are not. Real `ip netns`, veths and cgroups."""

from __future__ import annotations

import os
import subprocess

from kvferry.local.nodeagent import reaper
from kvferry.local.nodeagent.cgroups import CpuLimits
from kvferry.local.nodeagent.netns import NodeNetwork

from tests.waiting import wait_until


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _in_namespace(pid: int, ns_path: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(ns_path).st_ino
    except OSError:
        return False


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def test_only_names_whose_owner_pid_is_gone_are_stale() -> None:
    alive = {10, 11}.__contains__
    names = ["kvf-cpu-0-10", "kvf-cpu-0-12", "kvf-p5en-1-13", "kvf-nopid", "kvf-cpu-0-x"]
    assert reaper.stale(names, alive) == ["kvf-cpu-0-12", "kvf-p5en-1-13"]
    assert reaper.stale([f"kvf-cpu-0-{os.getpid()}"], lambda _: False) == []  # never our own
    assert reaper.owner_pid("cpu-0-4242") == 4242 and reaper.owner_pid("cpu") is None


def test_a_dead_agents_namespace_and_its_pods_go_and_a_live_agents_stay() -> None:
    dead = NodeNetwork(f"kvf-reaptest-{_dead_pid()}", "10.219.7.0/29")
    dead.setup("10.219.7.1")
    orphan = subprocess.Popen([*dead.exec_prefix(), "sleep", "300"])  # a pod its agent left running
    live = NodeNetwork(f"kvf-reaptest-{orphan.pid}", "10.219.8.0/29")  # owner pid running
    live.setup("10.219.8.1")
    try:
        wait_until(
            lambda: _in_namespace(orphan.pid, dead.ns_path), "the orphan inside the namespace", 30, 0.02
        )
        removed = reaper.reap()
        assert f"netns {dead.ns}" in removed and f"netns {live.ns}" not in removed
        assert orphan.wait(timeout=30) == -9  # killed: a namespace lives while a process is in it
        assert not os.path.exists(dead.ns_path)
        assert not _link_exists(dead.host_if)  # the veth holding the subnet's node IP is gone
        assert os.path.exists(live.ns_path) and _link_exists(live.host_if)
    finally:
        if orphan.poll() is None:
            orphan.kill()
        live.teardown()
        dead.teardown()


def test_a_dead_agents_cgroup_and_its_processes_go() -> None:
    limits = CpuLimits(f"reaptest-{_dead_pid()}")
    assert limits.available, limits.reason  # the node agent's CPU limits need it too
    group = limits.group("uid1", "main", 250)
    proc = subprocess.Popen(group.wrap(["sleep", "300"]))
    try:
        assert wait_until(group.pids, "the process in its cgroup", 30, 0.02) == [proc.pid]
        removed = reaper.reap()
        assert f"cgroup {limits.base}" in removed
        assert proc.wait(timeout=30) == -9 and not limits.base.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        limits.close()
