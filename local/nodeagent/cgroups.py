"""Limit step: a container's `resources.limits.cpu` enforced as the kubelet does, by a CFS quota on a
cgroup of its own.

Layout: `<cpu hierarchy>/kvferry/<agent>/pod<uid>/<container>`. The quota is the limit times the
period (100 ms), at least 1 ms, as the kubelet's milliCPUToQuota. cgroup v1 (a `cpu` controller
mount: cpu.cfs_period_us, cpu.cfs_quota_us) and v2 (the unified mount: `+cpu` in each parent's
cgroup.subtree_control, then cpu.max). A container's first process joins its cgroup before it execs
its command (a `sh` stub writes its own pid to cgroup.procs, then execs), so every process it forks
inherits the limit. Stopping a container kills what is left in its cgroup and removes it; the pod's
and the agent's directories go with them.

Where no writable cpu controller exists, `CpuLimits.reason` says why: the agent logs it, the
container runs unlimited and its pod carries a False `kvferry.io/CPULimitEnforced` condition with
that reason. A limit is never dropped silently.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

PERIOD_US = 100_000  # the kubelet's default cpu.cfs_period_us
MIN_QUOTA_US = 1_000  # the kubelet's MinQuotaPeriod
CONDITION = "kvferry.io/CPULimitEnforced"
_SUFFIX = {k: Decimal(v) for k, v in (("n", "1e-9"), ("u", "1e-6"), ("m", "1e-3"), ("", "1"), ("k", "1e3"))}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?([numk]?)$")
_RMDIR_WAIT_S = 3.0

log = logging.getLogger("kvferry.nodeagent")


class CgroupError(OSError):
    """A cgroup could not be made, configured or joined."""


def parse_cpu(value: str | int | float) -> int:
    """A CPU quantity ("500m", "0.5", "2", 1.5) in millicores, rounded up as the API server does."""
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"not a CPU quantity: {value!r}")
    try:
        number = Decimal(m.group(1)) * Decimal(10) ** int(m.group(2) or 0) * _SUFFIX[m.group(3)]
    except InvalidOperation as exc:
        raise ValueError(f"not a CPU quantity: {value!r}") from exc
    return math.ceil(number * 1000)


def quota_us(millicores: int, period_us: int = PERIOD_US) -> int:
    """CFS quota for a limit: limit × period, never below 1 ms (the kubelet's milliCPUToQuota)."""
    if millicores <= 0:
        raise ValueError("a CPU limit must be positive")
    return max(MIN_QUOTA_US, millicores * period_us // 1000)


def cpu_limit(container: dict[str, Any]) -> int | None:
    """The container's limits.cpu in millicores; None when it has none."""
    value = ((container.get("resources") or {}).get("limits") or {}).get("cpu")
    return None if value in (None, "") else parse_cpu(value)


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 1 or 2
    root: Path


def find_hierarchy(mounts: str) -> Hierarchy | None:
    """The mount holding the cpu controller, from /proc/self/mounts text: a v1 `cpu` mount wins over
    the unified (v2) one (on a hybrid host the cpu controller is on v1)."""
    v2 = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        path, fstype, options = fields[1], fields[2], fields[3].split(",")
        if fstype == "cgroup" and "cpu" in options:
            return Hierarchy(1, Path(path))
        if fstype == "cgroup2" and v2 is None:
            v2 = Hierarchy(2, Path(path))
    return v2


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise CgroupError(f"cannot write {text!r} to {path}: {exc.strerror}") from exc


class CpuLimits:
    """The agent's cgroups: `group()` per limited container, `remove_pod()`, `close()` at the end."""

    def __init__(self, name: str, mounts_file: str = "/proc/self/mounts") -> None:
        self.reason = ""
        self.hierarchy: Hierarchy | None = None
        try:
            hierarchy = find_hierarchy(Path(mounts_file).read_text())
        except OSError as exc:
            hierarchy, self.reason = None, f"cannot read {mounts_file}: {exc}"
        if hierarchy is None:
            self.reason = self.reason or "no cgroup cpu controller is mounted"
            return
        self.base = hierarchy.root / "kvferry" / name
        try:
            if hierarchy.version == 2:
                ctl = (hierarchy.root / "cgroup.controllers").read_text().split()
                if "cpu" not in ctl:
                    raise CgroupError(f"the cpu controller is not available in {hierarchy.root}")
                self._enable_cpu(hierarchy.root, self.base)
            self.base.mkdir(parents=True, exist_ok=True)
            if hierarchy.version == 2:
                _write(self.base / "cgroup.subtree_control", "+cpu")
        except OSError as exc:
            self.reason = f"cgroup v{hierarchy.version} at {hierarchy.root} is not writable: {exc}"
            return
        self.hierarchy = hierarchy

    @property
    def available(self) -> bool:
        return self.hierarchy is not None

    @staticmethod
    def _enable_cpu(root: Path, leaf_parent: Path) -> None:
        """v2: a child gets cpu.max only if every ancestor delegates the cpu controller."""
        here = root
        for part in leaf_parent.relative_to(root).parts:
            if "cpu" not in (here / "cgroup.subtree_control").read_text().split():
                _write(here / "cgroup.subtree_control", "+cpu")
            here = here / part
            here.mkdir(exist_ok=True)

    def group(self, pod_uid: str, container: str, millicores: int) -> ContainerCgroup:
        """Make (or reuse) the container's cgroup with its quota; raise CgroupError if impossible."""
        if self.hierarchy is None:
            raise CgroupError(self.reason)
        pod_dir = self.base / f"pod{pod_uid}"
        path = pod_dir / container
        quota = quota_us(millicores)
        try:
            pod_dir.mkdir(exist_ok=True)
            if self.hierarchy.version == 2:
                _write(pod_dir / "cgroup.subtree_control", "+cpu")
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot create {path}: {exc.strerror or exc}") from exc
        if self.hierarchy.version == 1:
            _write(path / "cpu.cfs_period_us", str(PERIOD_US))
            _write(path / "cpu.cfs_quota_us", str(quota))
        else:
            _write(path / "cpu.max", f"{quota} {PERIOD_US}")
        return ContainerCgroup(path, millicores)

    def remove_pod(self, pod_uid: str) -> None:
        pod_dir = self.base / f"pod{pod_uid}" if self.hierarchy else None
        if pod_dir is None or not pod_dir.is_dir():
            return
        remove_pod_dir(pod_dir)

    def close(self) -> None:
        if self.hierarchy is None or not self.base.is_dir():
            return
        for child in self.base.iterdir():
            if child.is_dir() and child.name.startswith("pod"):
                self.remove_pod(child.name[3:])
        remove_dir(self.base)
        with contextlib.suppress(OSError):
            self.base.parent.rmdir()  # kvferry/: only when no other agent uses it


@dataclass(frozen=True)
class ContainerCgroup:
    path: Path
    millicores: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run so that its first process joins this cgroup before it execs (same pid)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs), *argv]

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs.read_text().split()]
        except OSError:
            return []

    def remove(self) -> None:
        """Kill what is left in the cgroup (a container's processes end with it), then remove it."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        remove_dir(self.path)


def remove_pod_dir(pod_dir: Path) -> None:
    """A pod's cgroup: each container's (killing what is left in it), then the pod's own."""
    for child in pod_dir.iterdir():
        if child.is_dir():
            ContainerCgroup(child, 0).remove()
    remove_dir(pod_dir)


def remove_dir(path: Path) -> None:
    # A killed process leaves its cgroup a moment after the signal: retry EBUSY for a short while.
    deadline = time.monotonic() + _RMDIR_WAIT_S
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                log.warning("cgroup %s: still busy after %.0f s, left in place", path, _RMDIR_WAIT_S)
                return
            time.sleep(0.05)
