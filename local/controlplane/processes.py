"""Process step: start control-plane binaries with logs in files, wait for them with deadlines, stop by PID.

Each child runs in its own session so a stopped parent never leaves a half-killed group behind, and so
`kvferry cluster up` can return while the plane keeps running. Stopping is SIGTERM, a bounded wait, then
SIGKILL, always by the recorded PID (checked against /proc/<pid>/cmdline so a reused PID is left alone).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

STOP_GRACE_S = 10.0
SETPRIV = shutil.which("setpriv")  # util-linux; sets the parent-death signal, then execs (same PID)


class ControlPlaneError(RuntimeError):
    """The control plane could not start or a component died; the message names it and its log tail."""


def reserve_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (all held open together, so they never repeat within one call)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except FileNotFoundError:
        return "(no log)"


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = field(default=None, repr=False)
    pid: int | None = None

    def start(self, env: dict[str, str] | None = None, *, tie_to_parent: bool = True) -> Proc:
        """Start detached in its own session; `tie_to_parent` also SIGKILLs it if this thread dies."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv
        if tie_to_parent and SETPRIV:  # so a killed test run leaves no component behind
            argv = [SETPRIV, "--pdeathsig", "KILL", "--", *argv]  # nobody is left to wait for a graceful exit
        with self.log.open("ab") as fh:
            fh.write(f"$ {' '.join(self.argv)}\n".encode())
            fh.flush()
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.pid = self.popen.pid
        return self

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return self.pid is not None and pid_matches(self.pid, self.argv[0])

    def check_alive(self) -> None:
        if not self.alive():
            rc = self.popen.returncode if self.popen else "?"
            raise ControlPlaneError(f"{self.name} exited (rc={rc}); log {self.log}:\n{log_tail(self.log)}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.pid is None or not self.alive():
            self._reap()
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        if not _wait(lambda: not self.alive(), grace_s):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            _wait(lambda: not self.alive(), 5.0)
        self._reap()

    def _reap(self) -> None:
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=1)


def pid_matches(pid: int, exe: str) -> bool:
    """True if `pid` is alive and runs `exe` (guards against PID reuse when stopping from a state file)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return cmdline == exe and state != "Z"


def _wait(pred: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def wait_for(what: str, pred: Callable[[], bool], timeout_s: float, watch: list[Proc]) -> None:
    """Poll `pred` until true; fail fast if a watched process dies, and name `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    last = "predicate was false"
    while True:
        for p in watch:
            p.check_alive()
        try:
            if pred():
                return
        except Exception as e:  # noqa: BLE001 - not ready yet (connection refused, 404, ...): keep polling
            last = f"last error: {type(e).__name__}: {str(e)[:300]}"
        if time.monotonic() > deadline:
            logs = "".join(f"\n--- {p.name} ({p.log}):\n{log_tail(p.log, 8)}" for p in watch)
            raise ControlPlaneError(f"timed out after {timeout_s:.0f} s waiting for {what} ({last}){logs}")
        time.sleep(0.2)


def wait_until(what: str, pred: Callable[[], bool], timeout_s: float) -> None:
    """`wait_for` with no processes to watch: for tests waiting on cluster state."""
    wait_for(what, pred, timeout_s, [])
