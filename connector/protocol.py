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
  every rank has answered or is seen gone (consumer.py): a posted WRITE must not land in blocks vLLM
  has already given to another request. Notices that arrive before the expectation are buffered.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from kvferry.connector.actions import (
    Action,
    Key,
    NothingInFlight,
    Reject,
    Release,
    SendFailure,
    StartWrite,
)
from kvferry.connector.consumer import ConsumerCore
from kvferry.connector.identity import tokens_digest
from kvferry.connector.layout import LayoutError, overlapping_ranks
from kvferry.connector.limits import DEFAULT_LIMITS, TICK_BUDGET, Limits
from kvferry.connector.wire import Registration


# ---- producer -----------------------------------------------------------------------------------
@dataclass
class _Finished:
    block_ids: list[list[int]]
    num_tokens: int
    consumer_engine: str
    since: float
    expires: float
    token_ids: tuple[int, ...] | None = None  # the prompt's, for the consumer's digest (identity.py)
    targets: set[int] | None = None  # consumer ranks to write, known from the first registration
    regs: dict[int, Registration] = field(default_factory=dict)
    inflight: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    failed: bool = False
    digests: dict[int, str] = field(default_factory=dict)  # num_tokens -> tokens_digest, once each


Slot = tuple[Key, str, int]  # (key, consumer engine, consumer rank)
MAX_SLOTS_PER_KEY = 64  # parked registrations of one key (consumer ranks x engines)


class ProducerCore:
    """Rendezvous of 'prefill finished' and registrations on one producer TP rank.

    Each input validates and computes first and mutates last, so an input that is refused (or a
    bug that raises) leaves no half-done entry behind. Lookups by request id go through indexes, so
    a flood of registrations costs O(1) each, never a scan of every map. Only the prefill's own
    attempts (prefill_finished, prefill_aborted) supersede older ones: a registration's attempt is a
    peer's number."""

    def __init__(
        self,
        *,
        total_heads: int,
        rank: int,
        tp_size: int,
        limits: Limits = DEFAULT_LIMITS,
        identity: str = "",
    ) -> None:
        self.total_heads, self.rank, self.tp_size, self.limits = total_heads, rank, tp_size, limits
        self.identity = identity  # identity.model_digest of our weights: a registration must match it
        self.finished: dict[Key, _Finished] = {}
        # (key, consumer engine, consumer rank) -> (registration, arrived, consumer's deadline). The
        # engine is part of the slot: another engine registering the same key first (a replayed or
        # misrouted request) must not take the slot of the one the prefill names.
        self.parked: OrderedDict[Slot, tuple[Registration, float, float]] = OrderedDict()
        self.latest: OrderedDict[str, int] = OrderedDict()  # request_id -> newest attempt seen
        self.ended: OrderedDict[Key, str] = OrderedDict()  # recently released keys -> reason
        # (key, consumer engine) of Cancels for keys we held nothing of: that engine's registration or
        # our prefill naming it, still on their way, must not start a WRITE (other engines unaffected)
        self.cancelled: OrderedDict[tuple[Key, str], None] = OrderedDict()
        # Keys our own prefill named, with the consumer engine it named ("" when aborted): only a
        # registration for such a key may draw a Failure through a new handshake (SendFailure.verified).
        self.named: OrderedDict[Key, str] = OrderedDict()
        self._finished_of: dict[str, dict[Key, None]] = {}  # request_id -> its keys in `finished`
        # request_id -> attempt -> its slots in `parked`, in arrival order
        self._parked_of: dict[str, dict[int, dict[Slot, None]]] = {}
        # (consumer's deadline, arrival, slot) of parked registrations: tick() finds the ones past
        # their deadline without a scan (entries of slots since unparked are skipped, then dropped)
        self._deadlines: list[tuple[float, float, Slot]] = []

    # inputs
    def prefill_finished(
        self,
        key: Key,
        block_ids: list[list[int]],
        num_tokens: int,
        consumer_engine: str,
        now: float,
        token_ids: tuple[int, ...] | None = None,
    ) -> list[Action]:
        if num_tokens < 0 or (token_ids is not None and len(token_ids) < num_tokens):
            n = "no" if token_ids is None else len(token_ids)
            return [Reject("malformed", f"prefill of {key}: {num_tokens} tokens, {n} token ids"),
                    Release(key, "malformed")]  # fmt: skip
        if self._superseded(key):
            return [
                Reject("superseded", f"prefill of {key} finished after a newer attempt"),
                Release(key, "superseded"),
            ]
        if key in self.finished:
            return [Reject("duplicate", f"prefill of {key} finished twice")]
        out = self._supersede_older(key, now)
        self._name(key, consumer_engine)
        if (key, consumer_engine) in self.cancelled and key not in self.ended:
            self._mark_ended(key, "cancelled")  # its consumer gave up before we had anything
        if key in self.ended:  # e.g. the consumer cancelled before the prefill finished: free at once
            return out + [Reject("late_prefill", f"prefill of {key} finished after it ended: "
                                 f"{self.ended[key]}"), Release(key, self.ended[key])]  # fmt: skip
        entry = _Finished(block_ids, num_tokens, consumer_engine, now, now + self.limits.lease_s, token_ids)
        self._hold(key, entry)
        out += self._evict_if_full_finished(now)
        for slot in self._slots(key):
            reg, _, deadline = self._unpark(slot)
            # The eviction above may have dropped this very entry (every older one has a WRITE
            # in flight): its waiting consumers are told, as for any evicted entry.
            if key not in self.finished:
                out.append(self._fail(reg, "producer_overloaded"))
                continue
            out += self._accept(key, reg, now, deadline)
        return out

    def prefill_aborted(self, key: Key, now: float) -> list[Action]:
        """The prefill will never finish (aborted or failed): fail consumers that already registered.
        Like any newer attempt, it releases what older attempts of the request still hold."""
        out = self._supersede_older(key, now)
        self._name(key, "")
        out.append(self._end(key, "prefill_aborted"))
        for slot in self._slots(key):
            reg, _, _ = self._unpark(slot)
            out.append(self._fail(reg, "prefill_aborted"))
        return out

    def registration(self, reg: Registration, now: float, deadline: float = float("inf")) -> list[Action]:
        """`deadline`: the consumer's deadline on this clock; no WRITE for `reg` starts after it."""
        key = (reg.request_id, reg.attempt)
        if key in self.finished and reg.consumer_rank in self.finished[key].regs:
            # First: a copy of a registration whose WRITE is under way (or done) is answered by that
            # WRITE. A Failure for it (superseded, deadline) could reach the consumer before the
            # WRITE ends and let it reuse blocks the WRITE still writes into.
            return [Reject("duplicate", f"second registration for {key} rank {reg.consumer_rank}")]
        # Validate before any state is read or changed: a registration we could never write (a TP
        # that cannot split the heads, a rank outside it or sharing no heads with us) is refused by
        # name and answered with nothing (its consumer is not one that rank could be).
        if why := self._unwritable(reg):
            return [Reject("unexpected_rank" if "shares no heads" in why else "malformed", f"{key}: {why}")]
        if reg.model_digest != self.identity:  # another model, revision, dtype, tokenizer...
            return [Reject("model_mismatch", f"{key}: consumer weights {reg.model_digest or '-'}, ours "
                           f"{self.identity or '-'}"), self._fail(reg, "model_mismatch")]  # fmt: skip
        if self._superseded(key):
            return [
                Reject("superseded", f"registration for {key}, newer attempt {self.latest[key[0]]}"),
                self._fail(reg, "superseded"),
            ]
        if self.ended.get(key) == "sent":
            return [Reject("duplicate", f"registration for {key} after its KV was sent")]
        if key in self.ended or (key, reg.consumer_engine) in self.cancelled:
            why = self.ended.get(key, "cancelled")
            return [Reject("late_registration", f"{key} already ended: {why}"), self._fail(reg, why)]
        if reg.first_token >= reg.num_tokens:  # nothing to write cannot be answered by a WRITE
            return [
                Reject("malformed", f"{key}: tokens [{reg.first_token}, {reg.num_tokens}) is empty"),
                self._fail(reg, "token_mismatch"),
            ]
        slot = (key, reg.consumer_engine, reg.consumer_rank)
        if key not in self.finished and slot in self.parked:
            return [Reject("duplicate", f"second registration for {key} rank {reg.consumer_rank}")]
        if key not in self.finished and len(self._slots(key)) >= MAX_SLOTS_PER_KEY:
            # A key has one slot per consumer rank of the engine the router chose; more are a flood
            # (every engine name an attacker makes up) that would make each look-up of the key a scan.
            return [Reject("overflow", f"{key}: {MAX_SLOTS_PER_KEY} registrations already parked")]
        # Only our own prefill's attempts supersede (prefill_finished, prefill_aborted): a registration
        # naming attempt 10^18 must not release, or refuse, what the prefill of a live attempt holds.
        out: list[Action] = []
        if now >= deadline:
            return out + [Reject("past_deadline", f"{key} registered after its deadline"),
                          self._fail(reg, "deadline")]  # fmt: skip
        if key in self.finished:
            return out + self._accept(key, reg, now, deadline)
        self._park(slot, (reg, now, deadline))
        while len(self.parked) > self.limits.max_entries:
            old_slot = next(iter(self.parked))
            old, _, _ = self._unpark(old_slot)
            # The key ends, as on a Cancel: a copy of `old` arriving later gets this Failure again,
            # not a WRITE into blocks its consumer freed on this one (and the prefill is freed at once).
            self._mark_ended(old_slot[0], "producer_overloaded")
            out += [
                Reject("overflow", f"parked registrations full; dropped {old.request_id}"),
                self._fail(old, "producer_overloaded"),
            ]
        return out

    def cancel(self, key: Key, consumer_engine: str, consumer_rank: int, now: float) -> list[Action]:
        """The consumer gave up: drop what is not yet written; in-flight writes finish first. Every
        Cancel of a rank with nothing in flight to it is answered (NothingInFlight): a consumer holds
        its blocks until each producer rank answers or is gone, however many Cancels that takes."""
        entry = self.finished.get(key)
        if entry is None:
            # Nothing of this key is held. The consumer's request failed as a whole: its parked
            # registrations are answered, and its registrations or our hand-over still on their way
            # are refused (no WRITE into blocks the consumer frees on our answer).
            out: list[Action] = []
            for slot in self._slots(key):
                if slot[1] == consumer_engine:
                    reg, _, _ = self._unpark(slot)
                    out.append(self._fail(reg, "cancelled"))
            self.cancelled[(key, consumer_engine)] = None
            while len(self.cancelled) > self.limits.max_entries:
                self.cancelled.popitem(last=False)
            if not any(isinstance(a, SendFailure) and a.reg.consumer_rank == consumer_rank for a in out):
                out.append(NothingInFlight(key, consumer_rank))
            return out
        if entry.consumer_engine != consumer_engine:
            # Only the engine our prefill named may cancel what is held; the canceller has nothing here.
            return [Reject("unknown_request", f"cancel for {key} from {consumer_engine}"),
                    NothingInFlight(key, consumer_rank)]  # fmt: skip
        # A registered rank is answered by its WRITE (Done, or write_finished's Failure, which needs
        # the registration kept); a Failure now could overtake the WRITE's Done (failing a receive
        # whose KV landed) or reach the consumer while the WRITE still runs (blocks reused under it).
        # A rank that has not registered has no WRITE: it is answered now (and refused if its
        # registration comes later, the entry having failed).
        silent = consumer_rank not in entry.regs and consumer_rank not in entry.inflight
        entry.failed = True
        answer: list[Action] = [NothingInFlight(key, consumer_rank)] if silent else []
        return answer + self._maybe_release(key, now)

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
        out: list[Action] = [self._fail(entry.regs.pop(consumer_rank), reason)]
        entry.failed = True
        return out + self._maybe_release(key, now)

    def tick(self, now: float) -> list[Action]:
        out: list[Action] = []
        for key, entry in list(self.finished.items()):
            if now >= entry.expires and not entry.inflight:  # never free blocks a WRITE is reading
                out += [self._fail(r, "lease_expired") for n, r in entry.regs.items() if n not in entry.done]
                out.append(self._end(key, "lease_expired"))
        # Parked registrations past their deadline (a heap), then past the TTL (arrival order: a
        # prefix); never a scan of every one, which a flood of them would make each round pay.
        budget = TICK_BUDGET
        while self._deadlines and self._deadlines[0][0] <= now and budget > 0:
            deadline, since, slot = heapq.heappop(self._deadlines)
            if slot in self.parked and self.parked[slot][1:] == (since, deadline):
                reg, _, _ = self._unpark(slot)
                out.append(self._fail(reg, "deadline"))
                budget -= 1
        budget = TICK_BUDGET
        while self.parked and budget > 0:
            budget -= 1
            slot, (reg, since, _) = next(iter(self.parked.items()))
            if now - since < self.limits.registration_ttl_s:
                break
            self._unpark(slot)
            self._mark_ended(slot[0], "registration_expired")  # as for an overflow, above
            out += [
                Reject("registration_expired", f"no prefill for {slot[0]} within the TTL"),
                self._fail(reg, "registration_expired"),
            ]
        if not self.parked:
            self._deadlines.clear()
        elif len(self._deadlines) > 2 * len(self.parked) + 64:  # drop entries of slots since unparked
            self._deadlines = [(d, t, s) for s, (_, t, d) in self.parked.items()]
            heapq.heapify(self._deadlines)
        return out

    def pending(self) -> dict[str, int]:
        inflight = sum(len(e.inflight) for e in self.finished.values())
        return {
            "finished_blocks": len(self.finished),
            "registrations": len(self.parked),
            "inflight": inflight,
        }

    # helpers
    def _unwritable(self, reg: Registration) -> str:
        """Why no WRITE of this rank could ever answer `reg` ("" if one can); pure."""
        if reg.consumer_tp <= 0 or reg.consumer_rank >= reg.consumer_tp:
            return f"consumer rank {reg.consumer_rank} of tp {reg.consumer_tp}"
        try:
            targets = self._targets(reg.consumer_tp)
        except LayoutError as exc:  # e.g. a TP that does not divide the heads
            return str(exc)
        if reg.consumer_rank not in targets:
            return f"consumer rank {reg.consumer_rank} of tp {reg.consumer_tp} shares no heads with ours"
        return ""

    def _targets(self, consumer_tp: int) -> set[int]:
        return set(overlapping_ranks(self.total_heads, self.rank, self.tp_size, consumer_tp))

    def _fail(self, reg: Registration, reason: str) -> SendFailure:
        """A Failure for `reg`: verified when our prefill named its key and its consumer engine."""
        key = (reg.request_id, reg.attempt)
        return SendFailure(reg, reason, verified=self.named.get(key) == reg.consumer_engine)

    def _accept(self, key: Key, reg: Registration, now: float, deadline: float) -> list[Action]:
        """`reg` passed registration()'s checks (`_unwritable`): this cannot raise."""
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
                self._fail(reg, "token_mismatch"),
            ]
        if reg.tokens_digest != self._digest(entry, reg.num_tokens):  # same count, other tokens
            return [
                Reject("token_mismatch", f"{key}: the consumer's first {reg.num_tokens} prompt tokens "
                       "are not the prefill's (tokenizer, chat template?)"),
                self._fail(reg, "token_mismatch"),
            ]  # fmt: skip
        if reg.consumer_rank in entry.regs:
            return [Reject("duplicate", f"second registration for {key} rank {reg.consumer_rank}")]
        entry.targets = entry.targets or self._targets(reg.consumer_tp)
        if entry.failed or now >= deadline:  # past the deadline its blocks may hold another request
            entry.failed = True  # (not in entry.regs: _maybe_release must not fail it a second time)
            why = "transfer_failed" if now < deadline else "deadline"
            return [self._fail(reg, why)] + self._maybe_release(key, now)
        entry.regs[reg.consumer_rank] = reg
        entry.inflight.add(reg.consumer_rank)
        return [StartWrite(key, reg, entry.block_ids, entry.num_tokens, now - entry.since, deadline)]

    @staticmethod
    def _digest(entry: _Finished, num_tokens: int) -> str:
        if num_tokens not in entry.digests:
            entry.digests[num_tokens] = tokens_digest(entry.token_ids, num_tokens)
        return entry.digests[num_tokens]

    def _maybe_release(self, key: Key, now: float) -> list[Action]:
        entry = self.finished[key]
        if entry.inflight:
            return []
        if entry.targets is not None and entry.done >= entry.targets:
            return [self._end(key, "sent")]
        if entry.failed:
            out: list[Action] = [
                self._fail(r, "transfer_failed") for n, r in entry.regs.items() if n not in entry.done
            ]
            return out + [self._end(key, "failed")]
        return []

    def _hold(self, key: Key, entry: _Finished) -> None:
        self.finished[key] = entry
        self._finished_of.setdefault(key[0], {})[key] = None

    def _end(self, key: Key, reason: str) -> Release:
        if self.finished.pop(key, None) is not None:
            keys = self._finished_of[key[0]]
            del keys[key]
            if not keys:
                del self._finished_of[key[0]]
        self._mark_ended(key, reason)
        return Release(key, reason)

    def _park(self, slot: Slot, value: tuple[Registration, float, float]) -> None:
        self.parked[slot] = value
        if value[2] != float("inf"):
            heapq.heappush(self._deadlines, (value[2], value[1], slot))
        self._parked_of.setdefault(slot[0][0], {}).setdefault(slot[0][1], {})[slot] = None

    def _unpark(self, slot: Slot) -> tuple[Registration, float, float]:
        value = self.parked.pop(slot)
        (rid, attempt), attempts = slot[0], self._parked_of[slot[0][0]]
        del attempts[attempt][slot]
        if not attempts[attempt]:
            del attempts[attempt]
            if not attempts:
                del self._parked_of[rid]
        return value

    def _slots(self, key: Key) -> list[Slot]:
        """The parked slots of `key`, in arrival order (at most MAX_SLOTS_PER_KEY)."""
        return list(self._parked_of.get(key[0], {}).get(key[1], ()))

    def _name(self, key: Key, consumer_engine: str) -> None:
        self.named[key] = consumer_engine
        self.named.move_to_end(key)
        while len(self.named) > self.limits.max_entries:
            self.named.popitem(last=False)

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
        for old in [k for k in self._finished_of.get(key[0], ()) if k[1] < key[1]]:
            entry = self.finished[old]
            if entry.inflight:
                entry.failed, entry.expires = True, now  # released when its WRITE completes
                continue
            out += [self._fail(r, "superseded") for n, r in entry.regs.items() if n not in entry.done]
            out.append(self._end(old, "superseded"))
        older = self._parked_of.get(key[0], {})
        for slot in [s for attempt in list(older) if attempt < key[1] for s in older[attempt]]:
            reg, _, _ = self._unpark(slot)
            out.append(self._fail(reg, "superseded"))
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
                    self._fail(r, "producer_overloaded") for n, r in entry.regs.items() if n not in entry.done
                ]
                out.append(self._end(key, "overflow"))
        return out


__all__ = ["TICK_BUDGET", "ConsumerCore", "Limits", "ProducerCore"]  # the consumer's is in consumer.py
