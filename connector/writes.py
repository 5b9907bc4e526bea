"""Writes step: the WRITEs a producer rank has posted, until NIXL says they ended (endpoint thread).

A posted WRITE cannot be stopped from either side. Measured with NIXL's UCX backend over TCP
(docs/verification.md, "A WRITE cannot be called back"): releasing a live transfer handle succeeds and
the data still lands, all of it, as the worker progresses; so does removing the peer agent, on either
side. A WRITE is therefore over only when NIXL reports DONE or ERR, never on a timer, and its
registration is answered (Done or Failure) only then.

The consumer holds its blocks past its deadline until this rank answers or is gone (consumer.py). A
WRITE still running at the consumer's deadline + grace_s / 2 (this rank's clock) would keep them held:
the rank then fences itself. `fence` raises `StuckWrite` before anything in a round
drives progress, and the endpoint stops without touching NIXL again (no release, no disconnect: both
would progress the worker and push more of the WRITE), so the engine fails loudly and its restart ends
the connection.
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
    must_end_by: float  # the consumer's deadline + grace_s / 2, this rank's clock


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
    reason: str  # "" when ok, else write_failed (NIXL reported an error)


class StuckWrite(RuntimeError):
    """A WRITE still running when its consumer may already have freed the blocks it writes into."""


class InFlight:
    def __init__(self) -> None:
        self.writes: list[Write] = []
        self.recent: deque[WriteRecord] = deque(maxlen=256)  # appended by the thread; read after the fact

    def __bool__(self) -> bool:
        return bool(self.writes)

    def agents(self) -> set[str]:
        return {w.agent for w in self.writes}

    def add(self, write: Write) -> None:
        self.writes.append(write)

    def fence(self, now: float) -> None:
        """Raise StuckWrite when a WRITE outlived its bound. Call before anything that drives the
        agent's progress (reading notifications does too): one more progress round pushes more of it."""
        stuck = [w for w in self.writes if now > w.must_end_by]
        if stuck:
            w = stuck[0]
            raise StuckWrite(
                f"WRITE of {w.key} to consumer rank {w.rank} ({w.plan.nbytes} bytes) still running "
                f"{now - w.started:.1f}s after it was posted, past the consumer's deadline + grace/2: "
                "it could land in blocks the consumer has freed; stopping this rank's transfers"
            )

    def check(self, transport: NixlTransport, now: float) -> list[Outcome]:
        """Poll every WRITE (this also drives UCX progress); return those that ended and were released."""
        self.fence(now)
        out: list[Outcome] = []
        for w in list(self.writes):
            state = transport.state(w.handle)
            if state == "PROC":
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
            out.append(Outcome(w, state == "DONE", "" if state == "DONE" else "write_failed"))
        return out

    def release_all(self, transport: NixlTransport) -> None:
        """At shutdown: let NIXL finish or fail what is still in flight."""
        for w in self.writes:
            try:
                transport.release(w.handle)
            except Exception as exc:
                log.debug("releasing a write at shutdown: %s", exc)
        self.writes.clear()
