"""Process step: run one container as a local process group, restart it per restartPolicy, stop it.

Each start runs in a new session (its own process group), as a container's processes share one PID
namespace. Stopping follows a container runtime: SIGTERM to the main process only (PID 1 in a
container; vLLM's API server, which then drains and stops its engine core itself), then SIGKILL to
the whole group after the grace period or as soon as the main process exited, as the runtime's
teardown of the PID namespace does. Restarts back off 1 s, 2 s, 4 s ... capped at MAX_BACKOFF_S
(the kubelet's 10 s ... 5 min would make the demo's recovery slow to watch; the shape is the same).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvferry.local.nodeagent.cgroups import ContainerCgroup
from kvferry.local.nodeagent.podspec import LaunchPlan
from kvferry.local.nodeagent.probes import ProbeState, run_once

MAX_BACKOFF_S = 16.0
KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the kernel to reap the group


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def kill_group(proc: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM the main process, SIGKILL the group once it exited or after `grace_s`; return the main
    process's exit code (None if unknown).

    Only the main process gets SIGTERM, as in a container: a signal to every process at once would
    make a server's children stop on their own while the server still drains through them.
    """
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        code: int | None = proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        code = None
    _reap_group(proc.pid)
    if code is None:
        try:
            code = proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            code = proc.poll()
    return code


def _reap_group(pgid: int) -> None:
    # The leader exited; children it left in the group (e.g. vLLM's engine core) must not outlive it.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class Terminated:
    exit_code: int
    started_at: str
    finished_at: str


class ContainerRunner:
    """One container of a pod: its current process, restart count, probes and last termination."""

    def __init__(
        self,
        spec: dict[str, Any],
        plan: LaunchPlan,
        log_dir: Path,
        pod_ip: str,
        restart_policy: str,
        grace_s: float,
    ) -> None:
        self.spec, self.plan, self.pod_ip = spec, plan, pod_ip
        self.restart_policy, self.grace_s = restart_policy, grace_s
        self.log_path = log_dir / f"{plan.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restart_count = 0
        self.started_at = ""
        self.last: Terminated | None = None
        self.next_start_at = 0.0
        self.waiting_reason = "ContainerCreating"
        self.startup = self.readiness = self.liveness = ProbeState(None, True)
        # limits.cpu: the cgroup that enforces it, or why it is not enforced (see cgroups.py)
        self.cgroup: ContainerCgroup | None = None
        self.limit_note = ""

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"--- {now_iso()} start: {' '.join(self.plan.argv)}\n".encode())
            if self.limit_note:
                log.write(f"--- {self.limit_note}\n".encode())
            log.flush()
            # In its cgroup before exec: the command and all it forks run under the CPU limit.
            argv = self.cgroup.wrap(self.plan.argv) if self.cgroup is not None else self.plan.argv
            try:
                self.proc = subprocess.Popen(
                    argv,
                    env=self.plan.env,
                    cwd=self.plan.cwd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:
                log.write(f"--- cannot start: {exc}\n".encode())
                self.proc = None
                self._record_exit(127)
                self.waiting_reason = "RunContainerError"
                return
        self.started_at = now_iso()
        self.startup = ProbeState(self.spec.get("startupProbe"), True)
        self.readiness = ProbeState(self.spec.get("readinessProbe"), True)
        # A container is alive until its liveness probe fails failureThreshold times in a row.
        self.liveness = ProbeState(self.spec.get("livenessProbe"), True, initial=True)

    def pre_stop(self, budget_s: float) -> None:
        """Run the container's preStop hook (sleep or exec), bounded by `budget_s`."""
        hook = (self.spec.get("lifecycle") or {}).get("preStop") or {}
        if "sleep" in hook:
            time.sleep(min(float(hook["sleep"].get("seconds", 0)), budget_s))
        elif "exec" in hook:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                argv = [*self.plan.exec_prefix, *hook["exec"]["command"]]
                subprocess.run(argv, env=self.plan.env, capture_output=True, timeout=budget_s)

    def stop(self, grace_s: float) -> None:
        if self.proc is not None:
            code = kill_group(self.proc, grace_s)
            self._record_exit(code if code is not None else 137)
            self.proc = None
        if self.cgroup is not None:
            self.cgroup.remove()
        self.next_start_at = float("inf")

    def _record_exit(self, code: int) -> None:
        self.last = Terminated(code, self.started_at or now_iso(), now_iso())

    @property
    def running(self) -> bool:
        return self.proc is not None

    @property
    def finished_ok(self) -> bool:
        return self.proc is None and self.last is not None and self.last.exit_code == 0

    def wants_restart(self) -> bool:
        if self.last is None:
            return True
        if self.restart_policy == "Always":
            return True
        return self.restart_policy == "OnFailure" and self.last.exit_code != 0

    # --- periodic work ---------------------------------------------------------------------------
    def tick(self, now: float) -> bool:
        """Poll the process, restart or probe it; return True when something visible changed."""
        if self.proc is None:
            if now >= self.next_start_at and self.wants_restart():
                if self.last is not None:
                    self.restart_count += 1
                self.start()
                return True
            return False
        code = self.proc.poll()
        if code is not None:
            _reap_group(self.proc.pid)
            self._exited(code, now)
            return True
        return self._probe(now)

    def _exited(self, code: int, now: float) -> None:
        self.proc = None
        self._record_exit(code)
        backoff = min(MAX_BACKOFF_S, 2.0**self.restart_count)
        self.next_start_at = now + backoff
        self.waiting_reason = "CrashLoopBackOff" if self.wants_restart() else "Completed"

    def _probe(self, now: float) -> bool:
        before = (self.startup.result, self.readiness.result)
        env = self.plan.env
        if self.startup.result is not True:
            if self.startup.due(now):
                self.startup.record(
                    run_once(self.startup.probe, self.spec, self.pod_ip, env, self.plan.exec_prefix), now
                )
                if self.startup.failed_out:
                    self._restart_unhealthy("startup")
                    return True
        else:
            for state in (self.readiness, self.liveness):
                if state.due(now):
                    state.record(
                        run_once(state.probe, self.spec, self.pod_ip, env, self.plan.exec_prefix), now
                    )
            if self.liveness.result is False:
                self._restart_unhealthy("liveness")
                return True
        return before != (self.startup.result, self.readiness.result)

    def _restart_unhealthy(self, which: str) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"--- {now_iso()} {which} probe failed: restarting\n".encode())
        assert self.proc is not None
        code = kill_group(self.proc, self.grace_s)
        self._exited(code if code is not None else 137, time.monotonic())

    # --- status ----------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.running and self.startup.result is True and self.readiness.result is True

    def status(self) -> dict[str, Any]:
        """This container's entry in pod.status.containerStatuses."""
        state: dict[str, Any]
        if self.proc is not None:
            state = {"running": {"startedAt": self.started_at}}
        elif self.last is not None and not self.wants_restart():
            state = {"terminated": self._terminated()}
        else:
            state = {"waiting": {"reason": self.waiting_reason}}
        entry = {
            "name": self.plan.name,
            "image": self.spec.get("image", "local"),
            "imageID": "",
            "containerID": f"kvferry-local://{self.proc.pid}" if self.proc else "",
            "ready": self.ready,
            "started": self.running and self.startup.result is True,
            "restartCount": self.restart_count,
            "state": state,
        }
        if self.last is not None:
            entry["lastState"] = {"terminated": self._terminated()}
        return entry

    def _terminated(self) -> dict[str, Any]:
        assert self.last is not None
        reason = "Completed" if self.last.exit_code == 0 else "Error"
        return {
            "exitCode": self.last.exit_code,
            "reason": reason,
            "startedAt": self.last.started_at,
            "finishedAt": self.last.finished_at,
        }
