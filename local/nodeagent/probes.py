"""Probe step: run a container's startup/readiness/liveness probes (httpGet, tcpSocket, exec) locally.

Semantics follow the kubelet: initialDelaySeconds, periodSeconds, timeoutSeconds, successThreshold and
failureThreshold; httpGet succeeds on 200-399; the probe host defaults to the pod IP; a named port is
looked up in the container's ports. A readiness probe only runs once the startup probe has passed.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvferry.local.nodeagent.podspec import PodSpecError


def _port(container: dict[str, Any], port: Any) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"container {container.get('name')}: probe port {port!r} is not a declared port name")


def run_once(
    probe: dict[str, Any],
    container: dict[str, Any],
    pod_ip: str,
    env: dict[str, str],
    prefix: tuple[str, ...] = (),
) -> bool:
    """One probe attempt, bounded by timeoutSeconds."""
    timeout = float(probe.get("timeoutSeconds", 1))
    if "httpGet" in probe:
        spec = probe["httpGet"]
        scheme = spec.get("scheme", "HTTP").lower()
        url = (
            f"{scheme}://{spec.get('host') or pod_ip}:{_port(container, spec['port'])}{spec.get('path', '/')}"
        )
        headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
        try:
            resp = httpx.get(url, headers=headers, timeout=timeout, verify=False)
        except httpx.HTTPError:
            return False
        return 200 <= resp.status_code < 400
    if "tcpSocket" in probe:
        spec = probe["tcpSocket"]
        try:
            with socket.create_connection(
                (spec.get("host") or pod_ip, _port(container, spec["port"])), timeout
            ):
                return True
        except OSError:
            return False
    if "exec" in probe:
        try:
            argv = [*prefix, *probe["exec"]["command"]]
            done = subprocess.run(argv, env=env, capture_output=True, timeout=timeout)
        except (subprocess.TimeoutExpired, OSError):
            return False
        return done.returncode == 0
    raise PodSpecError(f"container {container.get('name')}: probe has no httpGet, tcpSocket or exec: {probe}")


@dataclass
class ProbeState:
    """Result bookkeeping for one probe of one running container instance."""

    probe: dict[str, Any] | None
    default: bool  # the result when the container has no such probe
    initial: bool = False  # the result before failureThreshold is reached (liveness: True)
    started_at: float = field(default_factory=time.monotonic)
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    result: bool | None = None

    def __post_init__(self) -> None:
        self.result = self.default if self.probe is None else self.initial
        if self.probe is not None:
            self.next_at = self.started_at + float(self.probe.get("initialDelaySeconds", 0))

    def due(self, now: float) -> bool:
        return self.probe is not None and now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        assert self.probe is not None
        self.next_at = now + float(self.probe.get("periodSeconds", 10))
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= int(self.probe.get("failureThreshold", 3)):
                self.result = False

    @property
    def failed_out(self) -> bool:
        """True once failureThreshold consecutive failures happened (startup/liveness restart)."""
        return self.probe is not None and self.failures >= int(self.probe.get("failureThreshold", 3))
