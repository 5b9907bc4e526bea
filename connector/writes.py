"""Writes step: the WRITEs a producer rank has posted, until NIXL says they are done (endpoint thread).

A posted WRITE cannot be cancelled: NIXL refuses to release a live transfer, so its source blocks stay
held (and its peer agent loaded) until it completes, fails or outlives `timeout_s` and NIXL lets go.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvferry.connector.ratelimit import log_limited
from kvferry.connector.transport import NixlTransport, WritePlan

log = logging.getLogger(__name__)
Key = tuple[str, int]


@dataclass
class Write:
    key: Key
    rank: int  # consumer rank
    agent: str
    handle: Any
    started: float
    plan: WritePlan


@dataclass(frozen=True)
class WriteRecord:
    """One completed WRITE, kept in a short ring for the benchmark and debugging."""

    mode: str
    descriptors: int
    nbytes: int
    prep_s: float
    write_s: float


@dataclass(frozen=True)
class Outcome:
    write: Write
    ok: bool
    reason: str  # "" when ok: write_failed (NIXL error) or write_timeout


class InFlight:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.writes: list[Write] = []
        self.recent: deque[WriteRecord] = deque(maxlen=256)  # appended by the thread; read after the fact

    def __bool__(self) -> bool:
        return bool(self.writes)

    def agents(self) -> set[str]:
        return {w.agent for w in self.writes}

    def add(self, write: Write) -> None:
        self.writes.append(write)

    def check(self, transport: NixlTransport, now: float) -> list[Outcome]:
        """Poll every WRITE (this also drives UCX progress); return those that ended and were released."""
        out: list[Outcome] = []
        for w in list(self.writes):
            state = transport.state(w.handle)
            if state == "PROC" and now - w.started <= self.timeout_s:
                continue
            try:
                transport.release(w.handle)
            except Exception as exc:  # NIXL refuses to release a live transfer: keep the blocks held
                log_limited(log, logging.WARNING, "unreleasable", "kvferry: write %s to rank %d still "
                            "active after %.1fs: %s", w.key, w.rank, now - w.started, exc)  # fmt: skip
                continue
            self.writes.remove(w)
            if state == "DONE":
                p = w.plan
                self.recent.append(WriteRecord(p.mode, p.descriptors, p.nbytes, p.prep_s, now - w.started))
            reason = "" if state == "DONE" else "write_failed" if state == "ERR" else "write_timeout"
            out.append(Outcome(w, state == "DONE", reason))
        return out

    def release_all(self, transport: NixlTransport) -> None:
        """At shutdown: let NIXL finish or fail what is still in flight."""
        for w in self.writes:
            try:
                transport.release(w.handle)
            except Exception as exc:
                log.debug("releasing a write at shutdown: %s", exc)
        self.writes.clear()
