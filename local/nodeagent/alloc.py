"""Allocation step: give each pod an address in the node's subnet and each whole-CPU container cores.

Addresses: a private subnet that lives in the node's network namespace (see netns.py); the node
takes the subnet's first host address (the host side of the link) and pods the rest.
Cores: like the kubelet's static CPU-manager policy, a container that requests a whole number of
CPUs gets cores of its own, when free. vLLM-CPU learns them through VLLM_CPU_OMP_THREADS_BIND (its
"auto" reserves cores for the scheduler and NIXL and, on a 2-core machine, runs both servers on the
same cores: ~10x slower); other containers share every core.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from typing import Any

CPUSET_ENV = "KVFERRY_CPUSET"
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


class AllocationError(RuntimeError):
    """No address left in the node's subnet."""


class AddressPool:
    """Pod IPs from the node subnet, released when the pod's worker ends."""

    def __init__(self, cidr: str) -> None:
        net = ipaddress.ip_network(cidr)
        if not net.is_private or net.is_loopback:
            # Loopback is refused too: the API server rejects 127.x addresses in EndpointSlices.
            raise ValueError(f"pod subnet {cidr} must be private and not loopback (e.g. 10.213.0.0/24)")
        hosts = [str(h) for h in net.hosts()]
        if len(hosts) < 2:
            raise ValueError(f"pod subnet {cidr} has fewer than 2 host addresses")
        self.node_ip, self._free = hosts[0], hosts[1:]
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            if not self._free:
                raise AllocationError("no free pod address left in the node's subnet")
            return self._free.pop(0)

    def give_back(self, ip: str) -> None:
        with self._lock:
            self._free.append(ip)


def whole_cpus(container: dict[str, Any]) -> int:
    """Whole CPUs a container requests (requests, else limits); 0 for fractions or none."""
    res = container.get("resources") or {}
    value = str((res.get("requests") or {}).get("cpu") or (res.get("limits") or {}).get("cpu") or "")
    return int(value) if value.isdigit() else 0


class CorePool:
    """Exclusive cores for whole-CPU containers; the lowest free core first.

    `max_per_container` caps a grant: the node advertises more CPUs than this machine has, so a
    request of 2 must not take both cores of a 2-core machine from the other vLLM pod.
    """

    def __init__(self, cores: list[int] | None = None, max_per_container: int = 1) -> None:
        self._free = sorted(cores if cores is not None else os.sched_getaffinity(0))
        self.max_per_container = max_per_container
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        """min(n, cap) cores; [] when n is 0 or none are free (the container then shares)."""
        n = min(n, self.max_per_container)
        with self._lock:
            if n <= 0 or n > len(self._free):
                return []
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def give_back(self, cores: list[int]) -> None:
        with self._lock:
            self._free = sorted(self._free + cores)


def core_env(cores: list[int], container: dict[str, Any]) -> dict[str, str]:
    """Env for a pinned container; an explicit VLLM_CPU_OMP_THREADS_BIND in the spec wins."""
    if not cores:
        return {}
    cpuset = ",".join(map(str, cores))
    env = {CPUSET_ENV: cpuset}
    if not any(v.get("name") == OMP_BIND_ENV for v in container.get("env") or []):
        env[OMP_BIND_ENV] = cpuset
    return env
