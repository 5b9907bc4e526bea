"""Protocol step, consumer side: completion counting on one consumer TP rank (see protocol.py).

An expected transfer completes when every expected producer rank has reported (Done or Failure). At
its deadline the outstanding ranks are cancelled and the blocks stay quarantined until every rank has
answered or is seen gone: a posted WRITE cannot be stopped, and on RDMA it lands without its
producer's help, so no timer alone ever releases blocks a producer might still write. Past
deadline + `grace_s` a receive is *held*: its silent ranks are probed every `probe_s` (the endpoint
checks their side channels: a rank nothing listens for, or that restarted, is gone; a live one is
cancelled again), a gone rank counts as answered `drain_s` later (bytes already on their way land
first), and at most `max_held` receives are held at once: beyond that the rank takes no new
receive (`held_full`) rather than reuse a block. Notices that arrive before the expectation are
buffered, bounded in total and per key. Pure, like protocol.py.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvferry.connector.actions import (
    Action,
    Failed,
    Key,
    ProbeProducers,
    Received,
    Register,
    Reject,
    SendCancel,
)
from kvferry.connector.layout import LayoutError, overlapping_ranks
from kvferry.connector.limits import DEFAULT_LIMITS, TICK_BUDGET, Limits
from kvferry.connector.wire import Done, Failure
from kvferry.contracts.metrics import HELD


# ---- consumer -----------------------------------------------------------------------------------
@dataclass
class _Expected:
    producer_engine: str
    ranks: frozenset[int]
    since: float
    deadline: float
    done: set[int] = field(default_factory=set)
    failures: dict[int, str] = field(default_factory=dict)
    cancelled: bool = False  # the consumer's request ended early (abort)
    quarantine_until: float | None = None  # set at the deadline: waiting for outstanding ranks
    next_probe: float | None = None  # set once held (past quarantine_until): when to probe again
    gone: dict[int, float] = field(default_factory=dict)  # rank seen gone -> when it counts as answered


class ConsumerCore:
    """Completion counting on one consumer TP rank. As for the producer: validate first, mutate
    last; every input costs O(1) in the size of the maps (a flood of notices is cheap to drop)."""

    def __init__(self, *, total_heads: int, rank: int, tp_size: int, limits: Limits = DEFAULT_LIMITS) -> None:
        self.total_heads, self.rank, self.tp_size, self.limits = total_heads, rank, tp_size, limits
        self.expected: dict[Key, _Expected] = {}
        # key -> {(producer engine, rank): (notice, arrived)}; keys in arrival order of their first
        self.early: OrderedDict[Key, dict[tuple[str, int], tuple[Done | Failure, float]]] = OrderedDict()
        self.early_notices = 0  # notices in `early`, all keys together
        self.held = 0  # entries in `expected` held past deadline + grace_s (next_probe set)

    def expect(
        self, key: Key, producer_engine: str, producer_tp: int, deadline_s: float, now: float
    ) -> list[Action]:
        if key in self.expected:
            return [Reject("duplicate", f"{key} expected twice")]
        try:
            ranks = overlapping_ranks(self.total_heads, self.rank, self.tp_size, producer_tp)
        except LayoutError as exc:  # the request's params name a producer TP we cannot pair with
            return [Reject("malformed", f"{key}: producer tp {producer_tp}: {exc}"), Failed(key, "malformed")]
        if len(self.expected) >= self.limits.max_entries:
            return [
                Reject("overflow", f"too many pending receives; failing {key}"),
                Failed(key, "overloaded"),
            ]
        if self.held >= self.limits.max_held:
            return [
                Reject("held_full", f"{self.held} receives hold blocks a producer may write; failing {key}"),
                Failed(key, "held_full"),
            ]
        self.expected[key] = _Expected(producer_engine, frozenset(ranks), now, now + deadline_s)
        out: list[Action] = [Register(key, tuple(ranks))]
        buffered = self.early.pop(key, {})
        self.early_notices -= len(buffered)
        for notice, _ in buffered.values():
            out += self.notice(notice, now)
        return out

    def notice(self, msg: Done | Failure, now: float) -> list[Action]:
        key = (msg.request_id, msg.attempt)
        entry = self.expected.get(key)
        if entry is None:
            return self._buffer(key, msg, now)
        if msg.producer_engine != entry.producer_engine:
            return [
                Reject(
                    "unexpected_engine",
                    f"{key}: notice from {msg.producer_engine}, expected {entry.producer_engine}",
                )
            ]
        if msg.producer_rank not in entry.ranks:
            return [Reject("unexpected_rank", f"{key}: producer rank {msg.producer_rank} not expected")]
        if msg.producer_rank in entry.done or msg.producer_rank in entry.failures:
            return [Reject("duplicate", f"{key}: second notice from producer rank {msg.producer_rank}")]
        if isinstance(msg, Done):
            entry.done.add(msg.producer_rank)
        else:
            entry.failures[msg.producer_rank] = msg.reason
        return self._settle(key, now)

    def _buffer(self, key: Key, msg: Done | Failure, now: float) -> list[Action]:
        """A notice before its expectation: kept once per sender, within both bounds (O(1))."""
        sender = (msg.producer_engine, msg.producer_rank)
        buffered = self.early.get(key)
        if buffered is not None and sender in buffered:
            # Only a sender's first notice counts when replayed; keeping copies would let a
            # repeating peer grow this buffer without bound until the TTL.
            return [Reject("duplicate", f"{key}: second early notice from {sender}")]
        if buffered is not None and len(buffered) >= self.limits.max_notices_per_key:
            return [Reject("overflow", f"{key}: {len(buffered)} early notices already; dropped {sender}")]
        if buffered is None:
            buffered = self.early[key] = {}
        buffered[sender] = (msg, now)
        self.early_notices += 1
        out: list[Action] = []
        while len(self.early) > self.limits.max_entries or self.early_notices > self.limits.max_early_notices:
            dropped, notices = self.early.popitem(last=False)
            self.early_notices -= len(notices)
            out.append(Reject("overflow", f"early notices full; dropped {dropped}"))
        return out

    def abort(self, key: Key, now: float) -> list[Action]:
        """The consumer's request ended early: cancel outstanding ranks, keep waiting for writes
        already in flight (vLLM keeps the blocks of an aborted receive until we report it), so the
        blocks are not reused under a WRITE."""
        entry = self.expected.get(key)
        if entry is None or entry.cancelled:
            return []
        entry.cancelled = True
        return [SendCancel(key, self._outstanding(entry))]

    def tick(self, now: float) -> list[Action]:
        out: list[Action] = []
        for key, entry in list(self.expected.items()):
            if entry.gone:
                out += self._drained(key, entry, now)
                if key not in self.expected:
                    continue
            if (
                entry.quarantine_until is not None
                and entry.next_probe is None
                and now >= entry.quarantine_until
            ):
                # Still unanswered: never release on a timer; probe until answered or seen gone.
                self.held += 1
                entry.next_probe = now
            if entry.next_probe is not None:
                if now >= entry.next_probe and (silent := self._silent(entry)):
                    entry.next_probe = now + self.limits.probe_s
                    out.append(ProbeProducers(key, silent))
            elif entry.quarantine_until is None and now >= entry.deadline:
                # Outstanding ranks remain (else it settled): stop them, then wait for their answers.
                out += [SendCancel(key, self._outstanding(entry))] if not entry.cancelled else []
                entry.quarantine_until = now + self.limits.grace_s
        # Keys are in arrival order of their first notice: the expired ones are a prefix.
        budget = TICK_BUDGET
        while self.early and budget > 0:
            budget -= 1
            key, notices = next(iter(self.early.items()))
            if now - next(iter(notices.values()))[1] < self.limits.early_notice_ttl_s:
                break
            del self.early[key]
            self.early_notices -= len(notices)
            out.append(Reject("unknown_request", f"notices for {key} never matched a receive"))
        return out

    def producer_gone(self, key: Key, rank: int, now: float) -> list[Action]:
        """The endpoint saw producer rank `rank` of `key` gone (nothing listens at its side channel,
        or another incarnation does) and unloaded its agent: it counts as answered `drain_s` from
        now, once bytes already on their way have landed."""
        entry = self.expected.get(key)
        if entry is None or rank not in self._outstanding(entry) or rank in entry.gone:
            return []
        entry.gone[rank] = now + self.limits.drain_s
        return []

    def pending(self) -> dict[str, int]:
        quarantined = sum(e.quarantine_until is not None for e in self.expected.values())
        return {
            "receives": len(self.expected),
            "early_notices": len(self.early),
            "quarantined": quarantined,
            HELD: self.held,
        }

    def _outstanding(self, entry: _Expected) -> tuple[int, ...]:
        return tuple(sorted(entry.ranks - entry.done - set(entry.failures)))

    def _silent(self, entry: _Expected) -> tuple[int, ...]:
        return tuple(r for r in self._outstanding(entry) if r not in entry.gone)

    def _drained(self, key: Key, entry: _Expected, now: float) -> list[Action]:
        drained = [r for r, at in entry.gone.items() if now >= at and r in self._outstanding(entry)]
        for rank in drained:
            entry.failures[rank] = "producer_gone"
        return self._settle(key, now) if drained else []

    def _settle(self, key: Key, now: float) -> list[Action]:
        entry = self.expected[key]
        if self._outstanding(entry):
            return []
        del self.expected[key]
        self.held -= entry.next_probe is not None
        if entry.failures:
            late = entry.quarantine_until is not None  # "cancelled" answers to our deadline's Cancel
            return [Failed(key, "deadline" if late else next(iter(entry.failures.values())))]
        if entry.cancelled:
            return [Failed(key, "cancelled")]
        return [Received(key, now - entry.since)]
