"""CPU limits as the kubelet turns them into CFS quotas: quantities, quota math, which cgroup mount holds
the cpu controller, and the pod condition that says whether a limit is enforced."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from kvferry.local.nodeagent import cgroups, status

V1_HOST = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
"""
HYBRID = """\
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,cpu,cpuacct 0 0
"""
V2_HOST = "proc /proc proc rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n"


@pytest.mark.parametrize(
    ("value", "millicores"),
    [("500m", 500), ("0.5", 500), (".25", 250), ("250m", 250), ("1", 1000), ("2", 2000), (1.5, 1500),
     (2, 2000), ("1500m", 1500), ("0.0001", 1), ("100u", 1), ("5e-1", 500), ("1k", 1_000_000)],
)  # fmt: skip
def test_cpu_quantities_parse_to_millicores_rounding_up(value, millicores):
    assert cgroups.parse_cpu(value) == millicores


@pytest.mark.parametrize("value", ["", "half", "1Gi", "-1", "1.2.3", "m"])
def test_what_is_not_a_cpu_quantity_is_refused(value):
    with pytest.raises(ValueError):
        cgroups.parse_cpu(value)


def test_quota_is_limit_times_period_with_the_kubelets_floor():
    assert cgroups.quota_us(250) == 25_000
    assert cgroups.quota_us(500) == 50_000
    assert cgroups.quota_us(1500) == 150_000
    assert cgroups.quota_us(1) == 1_000  # 100 µs would be below the 1 ms minimum
    assert cgroups.quota_us(250, period_us=50_000) == 12_500
    with pytest.raises(ValueError):
        cgroups.quota_us(0)


def test_a_containers_limit_comes_from_limits_not_requests():
    assert cgroups.cpu_limit({"resources": {"limits": {"cpu": "250m"}}}) == 250
    assert cgroups.cpu_limit({"resources": {"requests": {"cpu": "1"}}}) is None
    assert cgroups.cpu_limit({}) is None


def test_the_cpu_controllers_mount_is_found_on_v1_v2_and_hybrid_hosts():
    assert cgroups.find_hierarchy(V1_HOST) == cgroups.Hierarchy(1, Path("/sys/fs/cgroup/cpu"))
    assert cgroups.find_hierarchy(HYBRID) == cgroups.Hierarchy(1, Path("/sys/fs/cgroup/cpu,cpuacct"))
    assert cgroups.find_hierarchy(V2_HOST) == cgroups.Hierarchy(2, Path("/sys/fs/cgroup"))
    assert cgroups.find_hierarchy("proc /proc proc rw 0 0\n") is None


def test_without_a_cpu_controller_limits_are_reported_not_dropped(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("proc /proc proc rw 0 0\n")
    limits = cgroups.CpuLimits("node-x", str(mounts))
    assert not limits.available and "no cgroup cpu controller" in limits.reason
    with pytest.raises(cgroups.CgroupError, match="no cgroup cpu controller"):
        limits.group("uid-1", "main", 250)


class _Runner:
    def __init__(self, name, cgroup=None, note=""):
        self.plan = type("Plan", (), {"name": name})()
        self.cgroup, self.limit_note = cgroup, note


def test_the_pod_condition_says_whether_each_limit_is_enforced(tmp_path):
    since: dict[str, str] = {}
    assert status.limit_condition([_Runner("main")], since) is None  # no limit, no condition
    group = cgroups.ContainerCgroup(tmp_path, 250)
    ok = status.limit_condition([_Runner("main", group), _Runner("side")], since)
    assert ok is not None and ok["type"] == cgroups.CONDITION and ok["status"] == "True"
    assert ok["message"] == "CFS quota on main: 250m"
    bad = status.limit_condition([_Runner("main", group), _Runner("b", note="b: not enforced: x")], since)
    assert bad is not None and bad["status"] == "False" and bad["reason"] == "CgroupUnavailable"
    assert bad["message"] == "b: not enforced: x"


def test_the_start_stub_joins_the_cgroup_then_execs_the_command(tmp_path):
    group = cgroups.ContainerCgroup(tmp_path, 250)
    (tmp_path / "cgroup.procs").write_text("")
    proc = subprocess.run(
        [*group.wrap(["sh", "-c", 'echo "$$ $1"', "x", "arg with space"])], capture_output=True
    )
    pid, arg = proc.stdout.decode().strip().split(" ", 1)
    # Same pid: the stub wrote its own pid, then exec'd (a plain file here stands in for cgroup.procs).
    assert (tmp_path / "cgroup.procs").read_text().strip() == pid and arg == "arg with space"
