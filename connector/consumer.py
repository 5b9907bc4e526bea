"""Protocol step, consumer side: completion counting on one consumer TP rank (see protocol.py).

An expected transfer completes when every expected producer rank has reported (Done or Failure). At
its deadline the outstanding ranks are cancelled and the blocks stay quarantined until every rank has
answered or `grace_s` more has passed. Notices that arrive before the expectation are buffered,
bounded in total and per key. Pure, like protocol.py.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvferry.connector.actions import Action, Failed, Key, Received, Register, Reject, SendCancel
from kvferry.connector.layout import LayoutError, overlapping_ranks
from kvferry.connector.limits import DEFAULT_LIMITS, TICK_BUDGET, Limits
from kvferry.connector.wire import Done, Failure


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


class ConsumerCore:
    """Completion counting on one consumer TP rank. As for the producer: validate first, mutate
    last; every input costs O(1) in the size of the maps (a flood of notices is cheap to drop)."""

    def __init__(self, *, total_heads: int, rank: int, tp_size: int, limits: Limits = DEFAULT_LIMITS) -> None:
        self.total_heads, self.rank, self.tp_size, self.limits = total_heads, rank, tp_size, limits
        self.expected: dict[Key, _Expected] = {}
        # key -> {(producer engine, rank): (notice, arrived)}; keys in arrival order of their first
        self.early: OrderedDict[Key, dict[tuple[str, int], tuple[Done | Failure, float]]] = OrderedDict()
        self.early_notices = 0  # notices in `early`, all keys together

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
        """The consumer's request ended early: cancel outstanding ranks, keep waiting (bounded) for
        writes already in flight so the blocks are not reused under a WRITE."""
        entry = self.expected.get(key)
        if entry is None or entry.cancelled:
            return []
        entry.cancelled = True
        return [SendCancel(key, self._outstanding(entry))]

    def tick(self, now: float) -> list[Action]:
        out: list[Action] = []
        for key, entry in list(self.expected.items()):
            if entry.quarantine_until is not None and now >= entry.quarantine_until:
                del self.expected[key]
                ranks = self._outstanding(entry)
                out.append(Reject("unanswered", f"{key}: producer ranks {list(ranks)} never answered; "
                                  f"blocks released {self.limits.grace_s}s after the deadline"))  # fmt: skip
                out.append(Failed(key, "deadline", tuple(sorted(ranks))))
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

    def pending(self) -> dict[str, int]:
        quarantined = sum(e.quarantine_until is not None for e in self.expected.values())
        return {"receives": len(self.expected), "early_notices": len(self.early), "quarantined": quarantined}

    def _outstanding(self, entry: _Expected) -> tuple[int, ...]:
        return tuple(sorted(entry.ranks - entry.done - set(entry.failures)))

    def _settle(self, key: Key, now: float) -> list[Action]:
        entry = self.expected[key]
        if self._outstanding(entry):
            return []
        del self.expected[key]
        if entry.failures:
            late = entry.quarantine_until is not None  # "cancelled" answers to our deadline's Cancel
            return [Failed(key, "deadline" if late else next(iter(entry.failures.values())))]
        if entry.cancelled:
            return [Failed(key, "cancelled")]
        return [Received(key, now - entry.since)]
