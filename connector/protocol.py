"""Protocol step: pure producer and consumer state machines (registration, rendezvous, completion).

No I/O and no clock: every input is a method call carrying `now`, every output is a list of
actions the caller carries out (send a notification, start a WRITE, release blocks, report a result).
Keys are (request_id, attempt), so a retried request never matches an older attempt's blocks or
registration. Every map is bounded in size and every entry in time:

producer: finished blocks live until written or until their lease expires, but never while a WRITE
  reads them; parked registrations expire after `registration_ttl_s` or at the consumer's deadline;
  no WRITE starts after the consumer's deadline; when an entry is dropped the consumer gets an
  explicit Failure so it fails fast instead of waiting for its deadline.
consumer: an expected transfer completes when every expected producer rank has reported (Done or
  Failure). At its deadline the outstanding ranks are cancelled and the blocks stay quarantined until
  every rank has answered or `grace_s` more has passed: a WRITE posted just before the deadline must
  not land in blocks vLLM has already given to another request. Notices that arrive before the
  expectation are buffered.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvferry.connector.actions import (
    Action,
    Failed,
    Key,
    Received,
    Register,
    Reject,
    Release,
    SendCancel,
    SendFailure,
    StartWrite,
)
from kvferry.connector.layout import overlapping_ranks
from kvferry.connector.wire import Done, Failure, Registration


@dataclass(frozen=True)
class Limits:
    lease_s: float = 30.0  # producer: how long finished blocks wait for a registration
    registration_ttl_s: float = 60.0  # producer: how long a registration waits for its prefill
    early_notice_ttl_s: float = 60.0  # consumer: how long a notice waits for its expectation
    max_entries: int = 4096  # per map
    grace_s: float = 2.0  # consumer: blocks stay quarantined this long past the deadline for answers


# ---- producer -----------------------------------------------------------------------------------
@dataclass
class _Finished:
    block_ids: list[list[int]]
    num_tokens: int
    consumer_engine: str
    since: float
    expires: float
    targets: set[int] | None = None  # consumer ranks to write, known from the first registration
    regs: dict[int, Registration] = field(default_factory=dict)
    inflight: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    failed: bool = False


class ProducerCore:
    """Rendezvous of 'prefill finished' and registrations on one producer TP rank."""

    def __init__(self, *, total_heads: int, rank: int, tp_size: int, limits: Limits = Limits()) -> None:
        self.total_heads, self.rank, self.tp_size, self.limits = total_heads, rank, tp_size, limits
        self.finished: dict[Key, _Finished] = {}
        # (key, consumer engine, consumer rank) -> (registration, arrived, consumer's deadline). The
        # engine is part of the slot: another engine registering the same key first (a replayed or
        # misrouted request) must not take the slot of the one the prefill names.
        self.parked: OrderedDict[tuple[Key, str, int], tuple[Registration, float, float]] = OrderedDict()
        self.latest: OrderedDict[str, int] = OrderedDict()  # request_id -> newest attempt seen
        self.ended: OrderedDict[Key, str] = OrderedDict()  # recently released keys -> reason

    # inputs
    def prefill_finished(
        self, key: Key, block_ids: list[list[int]], num_tokens: int, consumer_engine: str, now: float
    ) -> list[Action]:
        out: list[Action] = []
        if self._superseded(key):
            return [
                Reject("superseded", f"prefill of {key} finished after a newer attempt"),
                Release(key, "superseded"),
            ]
        out += self._supersede_older(key, now)
        if key in self.finished:
            return out + [Reject("duplicate", f"prefill of {key} finished twice")]
        if key in self.ended:  # e.g. the consumer cancelled before the prefill finished: free at once
            return out + [Reject("late_prefill", f"prefill of {key} finished after it ended: "
                                 f"{self.ended[key]}"), Release(key, self.ended[key])]  # fmt: skip
        self.finished[key] = _Finished(block_ids, num_tokens, consumer_engine, now, now + self.limits.lease_s)
        out += self._evict_if_full_finished(now)
        for slot, (reg, _, deadline) in list(self.parked.items()):
            if slot[0] == key:
                del self.parked[slot]
                # The eviction above may have dropped this very entry (every older one has a WRITE
                # in flight): its waiting consumers are told, as for any evicted entry.
                if key not in self.finished:
                    out.append(SendFailure(reg, "producer_overloaded"))
                    continue
                out += self._accept(key, reg, now, deadline)
        return out

    def prefill_aborted(self, key: Key, now: float) -> list[Action]:
        """The prefill will never finish (aborted or failed): fail consumers that already registered.
        Like any newer attempt, it releases what older attempts of the request still hold."""
        out = self._supersede_older(key, now)
        out.append(self._end(key, "prefill_aborted"))
        for slot, (reg, _, _) in list(self.parked.items()):
            if slot[0] == key:
                del self.parked[slot]
                out.append(SendFailure(reg, "prefill_aborted"))
        return out

    def registration(self, reg: Registration, now: float, deadline: float = float("inf")) -> list[Action]:
        """`deadline`: the consumer's deadline on this clock; no WRITE for `reg` starts after it."""
        key = (reg.request_id, reg.attempt)
        if key in self.finished and reg.consumer_rank in self.finished[key].regs:
            # First: a copy of a registration whose WRITE is under way (or done) is answered by that
            # WRITE. A Failure for it (superseded, deadline) could reach the consumer before the
            # WRITE ends and let it reuse blocks the WRITE still writes into.
            return [Reject("duplicate", f"second registration for {key} rank {reg.consumer_rank}")]
        if self._superseded(key):
            return [
                Reject("superseded", f"registration for {key}, newer attempt {self.latest[key[0]]}"),
                SendFailure(reg, "superseded"),
            ]
        if self.ended.get(key) == "sent":
            return [Reject("duplicate", f"registration for {key} after its KV was sent")]
        if key in self.ended:
            return [
                Reject("late_registration", f"{key} already ended: {self.ended[key]}"),
                SendFailure(reg, self.ended[key]),
            ]
        if reg.consumer_tp <= 0 or reg.consumer_rank >= reg.consumer_tp:
            return [Reject("malformed", f"consumer rank {reg.consumer_rank} of tp {reg.consumer_tp}")]
        if reg.first_token >= reg.num_tokens:  # nothing to write cannot be answered by a WRITE
            return [
                Reject("malformed", f"{key}: tokens [{reg.first_token}, {reg.num_tokens}) is empty"),
                SendFailure(reg, "token_mismatch"),
            ]
        out = self._supersede_older(key, now)
        if now >= deadline:
            return out + [Reject("past_deadline", f"{key} registered after its deadline"),
                          SendFailure(reg, "deadline")]  # fmt: skip
        if key in self.finished:
            return out + self._accept(key, reg, now, deadline)
        slot = (key, reg.consumer_engine, reg.consumer_rank)
        if slot in self.parked:
            return out + [Reject("duplicate", f"second registration for {key} rank {reg.consumer_rank}")]
        self.parked[slot] = (reg, now, deadline)
        while len(self.parked) > self.limits.max_entries:
            ((old_key, _, _), (old, _, _)) = self.parked.popitem(last=False)
            # The key ends, as on a Cancel: a copy of `old` arriving later gets this Failure again,
            # not a WRITE into blocks its consumer freed on this one (and the prefill is freed at once).
            self._mark_ended(old_key, "producer_overloaded")
            out += [
                Reject("overflow", f"parked registrations full; dropped {old.request_id}"),
                SendFailure(old, "producer_overloaded"),
            ]
        return out

    def cancel(self, key: Key, consumer_engine: str, consumer_rank: int, now: float) -> list[Action]:
        """The consumer gave up: drop what is not yet written; in-flight writes finish first."""
        # Only the engine that registered may cancel (as for held blocks below): another engine's
        # Cancel must not fail a registration it does not own (its slot is its own).
        if (key, consumer_engine, consumer_rank) in self.parked:
            # The consumer's request failed as a whole: other ranks' registrations and the prefill's
            # blocks need not wait for their TTL and lease.
            out: list[Action] = []
            for slot, (reg, _, _) in list(self.parked.items()):
                if slot[0] == key and reg.consumer_engine == consumer_engine:
                    del self.parked[slot]
                    out.append(SendFailure(reg, "cancelled"))
            self._mark_ended(key, "cancelled")  # nothing is held yet: no Release
            return out
        entry = self.finished.get(key)
        if entry is None or entry.consumer_engine != consumer_engine:
            return [Reject("unknown_request", f"cancel for {key} from {consumer_engine}")]
        # Nothing to send: a registered rank is answered by its WRITE (Done, or write_finished's
        # Failure, which needs the registration kept); a rank not registered yet is refused when it
        # registers. A Failure here could overtake the WRITE's Done (failing a receive whose KV
        # landed) or reach the consumer while the WRITE still runs (blocks reused under it).
        entry.failed = True
        return self._maybe_release(key, now)

    def write_finished(self, key: Key, consumer_rank: int, ok: bool, reason: str, now: float) -> list[Action]:
        entry = self.finished.get(key)
        if entry is None or consumer_rank not in entry.inflight:
            return [Reject("unknown_request", f"write result for {key} rank {consumer_rank}")]
        entry.inflight.discard(consumer_rank)
        if ok:
            entry.done.add(consumer_rank)
            return self._maybe_release(key, now)
        # The failure answers this rank: out of entry.regs, so _maybe_release below (and a later lease
        # expiry or supersede) does not send it a second Failure ("transfer_failed").
        out: list[Action] = [SendFailure(entry.regs.pop(consumer_rank), reason)]
        entry.failed = True
        return out + self._maybe_release(key, now)

    def tick(self, now: float) -> list[Action]:
        out: list[Action] = []
        for key, entry in list(self.finished.items()):
            if now >= entry.expires and not entry.inflight:  # never free blocks a WRITE is reading
                out += [SendFailure(r, "lease_expired") for n, r in entry.regs.items() if n not in entry.done]
                out.append(self._end(key, "lease_expired"))
        for slot, (reg, since, deadline) in list(self.parked.items()):
            if now >= deadline:
                del self.parked[slot]
                out.append(SendFailure(reg, "deadline"))
            elif now - since >= self.limits.registration_ttl_s:
                del self.parked[slot]
                self._mark_ended(slot[0], "registration_expired")  # as for an overflow, above
                out += [
                    Reject("registration_expired", f"no prefill for {slot[0]} within the TTL"),
                    SendFailure(reg, "registration_expired"),
                ]
        return out

    def pending(self) -> dict[str, int]:
        inflight = sum(len(e.inflight) for e in self.finished.values())
        return {
            "finished_blocks": len(self.finished),
            "registrations": len(self.parked),
            "inflight": inflight,
        }

    # helpers
    def _accept(self, key: Key, reg: Registration, now: float, deadline: float) -> list[Action]:
        entry = self.finished[key]
        if reg.consumer_engine != entry.consumer_engine:
            return [
                Reject(
                    "unexpected_engine",
                    f"{key} registered by {reg.consumer_engine}, expected {entry.consumer_engine}",
                )
            ]
        if reg.num_tokens > entry.num_tokens:  # e.g. the two legs tokenized the prompt differently
            return [
                Reject(
                    "token_mismatch",
                    f"{key}: consumer wants {reg.num_tokens} tokens, prefill has {entry.num_tokens}",
                ),
                SendFailure(reg, "token_mismatch"),
            ]
        targets = set(overlapping_ranks(self.total_heads, self.rank, self.tp_size, reg.consumer_tp))
        if reg.consumer_rank not in targets:
            return [Reject("unexpected_rank", f"{key}: consumer rank {reg.consumer_rank} shares no heads")]
        entry.targets = entry.targets or targets
        if reg.consumer_rank in entry.regs:
            return [Reject("duplicate", f"second registration for {key} rank {reg.consumer_rank}")]
        if entry.failed or now >= deadline:  # past the deadline its blocks may hold another request
            entry.failed = True  # (not in entry.regs: _maybe_release must not fail it a second time)
            why = "transfer_failed" if now < deadline else "deadline"
            return [SendFailure(reg, why)] + self._maybe_release(key, now)
        entry.regs[reg.consumer_rank] = reg
        entry.inflight.add(reg.consumer_rank)
        return [StartWrite(key, reg, entry.block_ids, entry.num_tokens, now - entry.since, deadline)]

    def _maybe_release(self, key: Key, now: float) -> list[Action]:
        entry = self.finished[key]
        if entry.inflight:
            return []
        if entry.targets is not None and entry.done >= entry.targets:
            return [self._end(key, "sent")]
        if entry.failed:
            out: list[Action] = [
                SendFailure(r, "transfer_failed") for n, r in entry.regs.items() if n not in entry.done
            ]
            return out + [self._end(key, "failed")]
        return []

    def _end(self, key: Key, reason: str) -> Release:
        self.finished.pop(key, None)
        self._mark_ended(key, reason)
        return Release(key, reason)

    def _mark_ended(self, key: Key, reason: str) -> None:
        self.ended[key] = reason
        while len(self.ended) > self.limits.max_entries:
            self.ended.popitem(last=False)

    def _note_attempt(self, key: Key) -> None:
        rid, attempt = key
        if attempt >= self.latest.get(rid, -1):
            self.latest[rid] = attempt
            self.latest.move_to_end(rid)
        while len(self.latest) > self.limits.max_entries:
            self.latest.popitem(last=False)

    def _superseded(self, key: Key) -> bool:
        return key[1] < self.latest.get(key[0], -1)

    def _supersede_older(self, key: Key, now: float) -> list[Action]:
        """A newer attempt releases everything an older attempt of the same request still holds."""
        self._note_attempt(key)
        out: list[Action] = []
        for old in [k for k in self.finished if k[0] == key[0] and k[1] < key[1]]:
            entry = self.finished[old]
            if entry.inflight:
                entry.failed, entry.expires = True, now  # released when its WRITE completes
                continue
            out += [SendFailure(r, "superseded") for n, r in entry.regs.items() if n not in entry.done]
            out.append(self._end(old, "superseded"))
        for slot, (reg, _, _) in list(self.parked.items()):
            old = slot[0]
            if old[0] == key[0] and old[1] < key[1]:
                del self.parked[slot]
                out.append(SendFailure(reg, "superseded"))
        return out

    def _evict_if_full_finished(self, now: float) -> list[Action]:
        out: list[Action] = []
        for key in list(self.finished):
            if len(self.finished) <= self.limits.max_entries:
                break
            if not self.finished[key].inflight:
                out += [Reject("overflow", f"finished blocks full; released {key}")]
                entry = self.finished[key]  # ranks already sent their KV got their Done: no Failure
                out += [
                    SendFailure(r, "producer_overloaded")
                    for n, r in entry.regs.items()
                    if n not in entry.done
                ]
                out.append(self._end(key, "overflow"))
        return out


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
    """Completion counting on one consumer TP rank."""

    def __init__(self, *, total_heads: int, rank: int, tp_size: int, limits: Limits = Limits()) -> None:
        self.total_heads, self.rank, self.tp_size, self.limits = total_heads, rank, tp_size, limits
        self.expected: dict[Key, _Expected] = {}
        self.early: OrderedDict[Key, list[tuple[Done | Failure, float]]] = OrderedDict()

    def expect(
        self, key: Key, producer_engine: str, producer_tp: int, deadline_s: float, now: float
    ) -> list[Action]:
        if key in self.expected:
            return [Reject("duplicate", f"{key} expected twice")]
        if len(self.expected) >= self.limits.max_entries:
            return [
                Reject("overflow", f"too many pending receives; failing {key}"),
                Failed(key, "overloaded"),
            ]
        ranks = overlapping_ranks(self.total_heads, self.rank, self.tp_size, producer_tp)
        self.expected[key] = _Expected(producer_engine, frozenset(ranks), now, now + deadline_s)
        out: list[Action] = [Register(key, tuple(ranks))]
        for notice, _ in self.early.pop(key, []):
            out += self.notice(notice, now)
        return out

    def notice(self, msg: Done | Failure, now: float) -> list[Action]:
        key = (msg.request_id, msg.attempt)
        entry = self.expected.get(key)
        if entry is None:
            buffered = self.early.setdefault(key, [])
            sender = (msg.producer_engine, msg.producer_rank)
            if any((n.producer_engine, n.producer_rank) == sender for n, _ in buffered):
                # Only a sender's first notice counts when replayed; keeping copies would let a
                # repeating peer grow this list without bound until the TTL.
                return [Reject("duplicate", f"{key}: second early notice from {sender}")]
            buffered.append((msg, now))
            if len(self.early) > self.limits.max_entries:
                dropped, _ = self.early.popitem(last=False)
                return [Reject("overflow", f"early notices full; dropped {dropped}")]
            return []
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
        for key, notices in list(self.early.items()):
            if now - notices[0][1] >= self.limits.early_notice_ttl_s:
                del self.early[key]
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
