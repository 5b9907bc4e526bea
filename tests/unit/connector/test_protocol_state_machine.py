"""protocol: a hypothesis state machine drives producer and consumer cores against each other.

One producer engine (TP ranks, one ProducerCore each) and one consumer engine (one ConsumerCore a
rank) share a fake clock and a lossy, reordering, duplicating network, wired the way the endpoint's
sides (producing.py, consuming.py) wire them: Register/SendCancel become Registration/Cancel
messages, StartWrite a WRITE that is handshaken, posted (after the endpoint's deadline re-check) and
completed, its Done carried to the consumer; SendFailure a Failure. Rules also crash either engine,
advance the clock past leases, TTLs, deadlines and grace_s, and send stale or foreign messages
(older attempts, ended or unknown keys, another engine's messages; revisions are checked before the
cores, by intake.admit), and hostile ones: registrations with ranks outside the TP, a TP that does
not divide the heads or a rank sharing no heads (each must be refused with no state changed and
nothing sent), and floods of notices for made-up keys and ranks (bounded in total and per key).
Checked after every step and at the end of every run:

  * each key ends exactly once: a hand-over (prefill_finished) is Released once; an accepted
    receive (expect) ends once, in Received or Failed; Received only when every producer rank's
    Done has landed; each registration a producer got is answered (Done or Failure) at most once
    per delivery and, once everything settles, at least once;
  * no block is released under a WRITE: a producer never Releases a key while a WRITE reading it
    is handshaking or posted, never starts one after the consumer's deadline or for released blocks,
    and never sends a Failure for a consumer rank it is writing to; a consumer never ends a key while
    a WRITE into its blocks is posted, and no WRITE is posted into blocks of a key it has ended; a
    receive held past deadline + grace is released only when each silent producer rank answered a
    (repeated) Cancel or was seen gone (its engine restarted), and a producer answers "nothing in
    flight" only for a rank no WRITE of its is under way to;
  * every map is bounded by Limits.max_entries, and finished/parked/expected/early drain to empty
    once every key has ended and the clock has passed every deadline, lease, TTL and grace.

The model assumes what the protocol does: a posted WRITE ends within WRITE_MAX_S, shorter than
grace_s minus the clock skew between the engines; the producer engine finishes or aborts each key
once (vLLM's scheduler; a second hand-over of a held key is tried and must be refused); a copy of a
registration arrives only while the producer remembers its key (`ended` and `latest` keep
max_entries keys).

The examples at the end are the bugs this machine found in protocol.py, one focused test each.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvferry.connector.actions import (
    Failed,
    NothingInFlight,
    ProbeProducers,
    Received,
    Register,
    Reject,
    Release,
    SendCancel,
    SendFailure,
    StartWrite,
)
from kvferry.connector.layout import overlapping_ranks
from kvferry.connector.protocol import ConsumerCore, Limits, ProducerCore
from kvferry.connector.wire import Cancel, Done, Failure, Registration

HEADS = 4
P_ENGINE, D_ENGINE, STRANGER = "p0", "d0", "x9"  # STRANGER: an admitted engine that is neither
KEYS = [(rid, attempt) for rid in ("a", "b") for attempt in (0, 1)]  # few: keys meet often
UNKNOWN = ("zz", 0)  # a key no one ever asks for
TOKENS = 40
GRACE_S, WRITE_MAX_S = 2.0, 1.0
LIMITS = st.builds(
    Limits,
    lease_s=st.sampled_from([1.0, 5.0]),
    registration_ttl_s=st.sampled_from([2.0, 8.0]),
    early_notice_ttl_s=st.sampled_from([2.0, 8.0]),
    max_entries=st.sampled_from([1, 2, 3, 8]),  # 8: every key of a run fits
    grace_s=st.just(GRACE_S),
    max_early_notices=st.sampled_from([16, 8192]),  # 16: a flood evicts honest notices too
    max_notices_per_key=st.sampled_from([4, 64]),
)
FLOOD = 40  # notices per flood rule: made-up keys and producer ranks outside any TP
pick = st.integers(0, 15)  # an index into whatever list a rule chooses from (taken modulo)


@dataclass
class Msg:
    to: str  # "P": to producer rank `rank`, "C": to consumer rank `rank`
    rank: int
    body: Registration | Cancel | Done | Failure


@dataclass
class Write:
    prank: int
    key: tuple[str, int]
    crank: int
    cgen: int  # the consumer incarnation it writes into
    deadline: float
    posted_at: float | None = None  # None: still handshaking (the endpoint has not posted it)


class Transfers(RuleBasedStateMachine):
    # ---- set-up -------------------------------------------------------------------------------
    @initialize(
        ptp=st.sampled_from([1, 2]),
        ctp=st.sampled_from([1, 2]),
        plimits=LIMITS,
        climits=LIMITS,  # each engine has its own configuration
        skew=st.sampled_from([0.0, 0.5, -0.5]),
    )
    def setup(self, ptp, ctp, plimits, climits, skew):
        self.ptp, self.ctp, self.plimits, self.climits = ptp, ctp, plimits, climits
        self.skew = skew  # producer clock minus consumer clock, as seen in deadlines (NTP)
        self.now = 0.0
        self.pgen = self.cgen = 0  # incarnations: a crash starts new cores
        self.producers = [self._producer(r) for r in range(ptp)]
        self.consumers = [self._consumer(r) for r in range(ctp)]
        self.net: list[Msg] = []
        self.writes: list[Write] = []
        # model of the producer engine (vLLM scheduler contract: each key is finished or aborted once)
        self.fate: dict[tuple[str, int], tuple[str, int]] = {}  # key -> (finished/aborted, pgen)
        self.held: dict[tuple[int, int, tuple[str, int]], str] = {}  # (pgen, prank, key) -> held/released
        self.reg_in: dict[tuple, int] = {}  # (pgen, prank, key, crank) -> registrations delivered
        self.answers: dict[tuple, int] = {}  # same slot -> Failures sent + WRITEs completed
        self.memory = [(set(), set()) for _ in range(ptp)]  # each core's ended keys, latest rids
        self.forgotten: set[tuple] = set()  # (pgen, prank, key): evicted from that core's memory
        self.superseded: set[tuple] = set()  # (pgen, prank, key): answered "superseded"
        # model of the consumer engine
        # key -> (deadline_s, tokens, first token: the consumer's own prefix-cache hit)
        self.cparams: dict[tuple[str, int], tuple[float, int, int]] = {}
        self.recv: dict[tuple[int, tuple[str, int]], str] = {}  # (crank, key) -> waiting/ended/lost
        self.rgen: dict[tuple[int, tuple[str, int]], int] = {}  # (crank, key) -> producer pgen at expect
        self.landed: dict[tuple[int, tuple[str, int]], set[int]] = {}  # Done delivered, by producer rank
        self.cancelled: set[tuple[str, int]] = set()  # keys a Cancel of the consumer reached a producer for
        self.max_deadline = 0.0

    def _producer(self, rank):
        return ProducerCore(total_heads=HEADS, rank=rank, tp_size=self.ptp, limits=self.plimits)

    def _consumer(self, rank):
        return ConsumerCore(total_heads=HEADS, rank=rank, tp_size=self.ctp, limits=self.climits)

    # ---- consumer engine ----------------------------------------------------------------------
    @rule(
        key=st.sampled_from(KEYS),
        rank=pick,
        every_rank=st.booleans(),  # as vLLM does it (one step's metadata); else one rank, late
        deadline_s=st.sampled_from([1.0, 3.0, 10.0]),
        extra=st.sampled_from([0, 0, 0, 8]),  # 8: the consumer asks for more tokens than prefilled
        held=st.sampled_from([0, 0, 16, 32]),  # tokens the consumer already holds (its prefix cache)
    )
    def expect(self, key, rank, every_rank, deadline_s, extra, held):
        """The consumer engine schedules the receive of `key`'s KV."""
        # every consumer rank is told the same (deadline, tokens, held); a key is never received twice
        deadline_s, tokens, held = self.cparams.setdefault(key, (deadline_s, TOKENS + extra, held))
        for crank in range(self.ctp) if every_rank else [rank % self.ctp]:
            core = self.consumers[crank]
            if (crank, key) in self.recv:
                if self.recv[crank, key] == "waiting":  # a duplicate expect is refused, not acted on
                    out = core.expect(key, P_ENGINE, self.ptp, deadline_s, self.now)
                    assert [type(a) for a in out] == [Reject], out
                continue
            self.recv[crank, key] = "waiting"
            self.rgen[crank, key] = self.pgen
            self.landed[crank, key] = set()
            self.max_deadline = max(self.max_deadline, self.now + deadline_s)
            self._consumer_did(crank, core.expect(key, P_ENGINE, self.ptp, deadline_s, self.now))

    @rule(key=st.sampled_from([*KEYS, UNKNOWN]), crank=pick, follow=st.booleans())
    def abort(self, key, crank, follow):
        """The consumer's request ends early (client gone); `follow`: one still waiting for KV."""
        crank %= self.ctp
        waiting = [k for (r, k), state in self.recv.items() if (r, state) == (crank, "waiting")]
        if follow and waiting:
            key = waiting[KEYS.index(key) % len(waiting) if key in KEYS else 0]
        self._consumer_did(crank, self.consumers[crank].abort(key, self.now))

    def _consumer_did(self, crank, actions):
        core = self.consumers[crank]
        for a in actions:
            if isinstance(a, Register):
                assert list(a.producer_ranks) == overlapping_ranks(HEADS, crank, self.ctp, self.ptp)
                entry = core.expected.get(a.key)
                if entry is None:  # settled by its buffered notices: the endpoint sends nothing
                    continue
                _, tokens, held = self.cparams[a.key]
                for prank in a.producer_ranks:
                    reg = Registration(
                        a.key[0], a.key[1], D_ENGINE, crank, self.ctp, "d", 5600, f"c{self.cgen}",
                        tokens, [[crank]], deadline_unix=entry.deadline, first_token=held,
                    )  # fmt: skip
                    self.net.append(Msg("P", prank, reg))
            elif isinstance(a, SendCancel):
                for prank in a.producer_ranks:
                    self.net.append(Msg("P", prank, Cancel(a.key[0], a.key[1], D_ENGINE, crank)))
            elif isinstance(a, ProbeProducers):
                # consuming.py: a producer engine restarted since the receive began is gone (its
                # WRITEs died with it); one still there is cancelled again
                assert self.now >= core.expected[a.key].deadline + self.climits.grace_s, a
                for prank in a.producer_ranks:
                    if self.pgen != self.rgen[crank, a.key]:
                        self._consumer_did(crank, core.producer_gone(a.key, prank, self.now))
                    else:
                        self.net.append(Msg("P", prank, Cancel(a.key[0], a.key[1], D_ENGINE, crank)))
            elif isinstance(a, Received | Failed):
                state = self.recv.get((crank, a.key))
                assert state == "waiting", f"{a} on rank {crank}: the receive was {state}"
                self.recv[crank, a.key] = "ended"
                under = [w for w in self._posted() if (w.crank, w.key, w.cgen) == (crank, a.key, self.cgen)]
                assert not under, f"{a}: blocks handed back while a WRITE into them is posted: {under}"
                if isinstance(a, Received):
                    want = set(overlapping_ranks(HEADS, crank, self.ctp, self.ptp))
                    assert self.landed[crank, a.key] >= want, (
                        f"{a} but only {self.landed[crank, a.key]} landed"
                    )
            else:
                assert isinstance(a, Reject), a

    # ---- producer engine ----------------------------------------------------------------------
    @rule(
        key=st.sampled_from(KEYS),
        rank=pick,
        every_rank=st.booleans(),
        abort=st.sampled_from([False, False, False, True]),
        follow=st.booleans(),  # rather a key the consumer asked for (most keys get both legs)
    )
    def prefill_ends(self, key, rank, every_rank, abort, follow):
        """vLLM finishes (hands over) or aborts the prefill of `key`: the engine decides once per
        key (every rank the same), never again after a restart."""
        asked = [k for _, k in self.recv if self.fate.get(k, (None, self.pgen))[1] == self.pgen]
        if follow and asked:
            key = asked[KEYS.index(key) % len(asked)]
        fate, gen = self.fate.setdefault(key, ("aborted" if abort else "finished", self.pgen))
        for prank in range(self.ptp) if every_rank else [rank % self.ptp]:
            slot = (self.pgen, prank, key)
            if gen != self.pgen or slot in self.held:
                continue
            core = self.producers[prank]
            if fate == "aborted":
                self.held[slot] = "aborted"
                self._producer_did(prank, core.prefill_aborted(key, self.now), aborted=key)
            else:
                self.held[slot] = "held"
                self._producer_did(prank, core.prefill_finished(key, [[prank]], TOKENS, D_ENGINE, self.now))

    # ---- each rank's endpoint thread ticks its core (not necessarily as soon as time passes) ----
    @rule(producer=st.booleans())
    def tick(self, producer):
        for r in range(self.ptp if producer else self.ctp):
            if producer:
                self._producer_did(r, self.producers[r].tick(self.now))
            else:
                self._consumer_did(r, self.consumers[r].tick(self.now))

    def _producer_did(self, prank, actions, aborted=None):
        """Check and carry out what producer rank `prank`'s core just returned."""
        core, (ended, latest) = self.producers[prank], self.memory[prank]
        # What the call made the core forget (its bounded memory): a copy of a registration for
        # such a key cannot be told from a new one, so the network below no longer delivers it.
        rids = latest - set(core.latest)
        self.forgotten |= {(self.pgen, prank, k) for k in ended - set(core.ended)}
        self.forgotten |= {s for s in self.superseded if s[:2] == (self.pgen, prank) and s[2][0] in rids}
        self.memory[prank] = (set(core.ended), set(core.latest))
        for a in actions:
            if isinstance(a, StartWrite):
                slot = (self.pgen, prank, a.key)
                assert self.held.get(slot) == "held", (
                    f"{a}: a WRITE from blocks not held ({self.held.get(slot)})"
                )
                assert self.now < a.deadline, f"{a}: started at {self.now}, after the consumer's deadline"
                # exactly the tokens the consumer lacks, all of which the prefill holds
                assert a.reg.first_token == self.cparams[a.key][2] < a.reg.num_tokens <= a.num_tokens, a
                self.writes.append(
                    Write(prank, a.key, a.reg.consumer_rank, int(a.reg.incarnation[1:]), a.deadline)
                )
            elif isinstance(a, SendFailure):
                reg = a.reg
                key = (reg.request_id, reg.attempt)
                busy = [
                    w for w in self.writes if (w.prank, w.key, w.crank) == (prank, key, reg.consumer_rank)
                ]
                assert not busy, f"{a}: Failure while a WRITE to that rank is in flight: {busy}"
                if a.reason == "cancelled":  # only the consumer itself may cancel its request
                    assert key in self.cancelled, f"{a}: no Cancel from {D_ENGINE}"
                self._answer(prank, key, reg.consumer_rank)
                if a.reason == "superseded":
                    self.superseded.add((self.pgen, prank, key))
                self.net.append(
                    Msg("C", reg.consumer_rank, Failure(key[0], key[1], P_ENGINE, prank, a.reason))
                )
            elif isinstance(a, Release):
                slot = (self.pgen, prank, a.key)
                reading = [w for w in self.writes if (w.prank, w.key) == (prank, a.key)]
                assert not reading, f"{a}: blocks released while a WRITE reads them: {reading}"
                if a.key == aborted:
                    assert a.reason == "prefill_aborted", a
                else:
                    assert self.held.get(slot) == "held", f"{a}: hand-over was {self.held.get(slot)}"
                    self.held[slot] = "released"
            else:
                assert isinstance(a, Reject), a

    def _answer(self, prank, key, crank):
        slot = (self.pgen, prank, key, crank)
        self.answers[slot] = self.answers.get(slot, 0) + 1
        got = self.reg_in.get(slot, 0)
        assert self.answers[slot] <= got, (
            f"{slot} answered {self.answers[slot]} times for {got} registrations"
        )

    # ---- the WRITE (endpoint + NIXL) ----------------------------------------------------------
    def _posted(self):
        return [w for w in self.writes if w.posted_at is not None]

    @precondition(lambda self: bool(self.writes))
    @rule(i=pick, ok=st.booleans())
    def write_progresses(self, i, ok):
        """A handshaking WRITE is posted (or its handshake fails); a posted one completes or fails."""
        w = self.writes[i % len(self.writes)]
        if w.posted_at is None:
            self._post(w, handshake_ok=ok)
        else:
            self._write_ends(w, ok, "write_failed")

    def _post(self, w, handshake_ok):
        if not handshake_ok or w.cgen != self.cgen:  # peer unreachable (or a dead consumer)
            self._write_ends(w, False, "handshake_failed")
        elif self.now >= w.deadline:  # ProducerSide._start_write re-checks the deadline before posting
            self._write_ends(w, False, "deadline")
        else:
            state = self.recv.get((w.crank, w.key))
            assert state == "waiting", f"WRITE posted into blocks of {w.key} on rank {w.crank}: {state}"
            w.posted_at = self.now

    def _write_ends(self, w, ok, reason):
        self.writes.remove(w)
        ok = ok and w.cgen == self.cgen
        if ok:  # Done rides with the WRITE: it is an answer to that consumer rank
            self._answer(w.prank, w.key, w.crank)
            self.net.append(Msg("C", w.crank, Done(w.key[0], w.key[1], P_ENGINE, w.prank)))
        out = self.producers[w.prank].write_finished(w.key, w.crank, ok, "" if ok else reason, self.now)
        self._producer_did(w.prank, out)

    # ---- network ------------------------------------------------------------------------------
    @precondition(lambda self: bool(self.net))
    @rule(i=pick, n=st.sampled_from([1, 3]))
    def deliver(self, i, n):
        """Up to `n` messages arrive, in any order."""
        for _ in range(min(n, len(self.net))):
            self._deliver(self.net.pop(i % len(self.net)))

    def _deliver(self, m):
        b = m.body
        if m.to == "C":
            if (
                isinstance(b, Done)
                and b.producer_engine == P_ENGINE
                and (m.rank, (b.request_id, b.attempt)) in self.recv
            ):
                self.landed[m.rank, (b.request_id, b.attempt)].add(b.producer_rank)
            self._consumer_did(m.rank, self.consumers[m.rank].notice(b, self.now))
            return
        core = self.producers[m.rank]
        if isinstance(b, Registration):
            slot = (self.pgen, m.rank, (b.request_id, b.attempt), b.consumer_rank)
            if self.reg_in.get(slot) and slot[:3] in self.forgotten:
                return  # a copy of a registration the producer can no longer know it answered
            if b.consumer_engine == D_ENGINE:
                self.reg_in[slot] = self.reg_in.get(slot, 0) + 1
            out = core.registration(b, self.now, b.deadline_unix + self.skew)
        else:
            key = (b.request_id, b.attempt)
            if b.consumer_engine == D_ENGINE:
                self.cancelled.add(key)
            out = core.cancel(key, b.consumer_engine, b.consumer_rank, self.now)
            for a in [a for a in out if isinstance(a, NothingInFlight)]:
                assert a.consumer_rank == b.consumer_rank, a
                busy = [w for w in self.writes if (w.prank, w.key, w.crank) == (m.rank, key, a.consumer_rank)]
                assert not busy, f"{a}: 'nothing in flight' while a WRITE to that rank is: {busy}"
                if b.consumer_engine == D_ENGINE:  # endpoint.py: a Failure to the canceller's agent
                    self.net.append(Msg("C", a.consumer_rank, Failure(*key, P_ENGINE, m.rank, "cancelled")))
            out = [a for a in out if not isinstance(a, NothingInFlight)]
        self._producer_did(m.rank, out)

    @precondition(lambda self: bool(self.net))
    @rule(i=pick, lose=st.booleans())
    def network_fault(self, i, lose):
        """A message is lost, or will arrive twice."""
        if lose:
            self.net.pop(i % len(self.net))
        else:
            self.net.append(self.net[i % len(self.net)])

    # ---- time and failures --------------------------------------------------------------------
    @rule(dt=st.sampled_from([0.1, 0.1, 0.5, 0.5, 1.0, 2.0, 5.0, 20.0]), ok=st.booleans())
    def advance(self, dt, ok):
        """Time passes; a posted WRITE ends within WRITE_MAX_S (the protocol's assumption)."""
        target = self.now + dt
        for w in sorted(self._posted(), key=lambda w: w.posted_at):
            if w.posted_at + WRITE_MAX_S <= target:
                self.now = max(self.now, w.posted_at + WRITE_MAX_S)
                self._write_ends(w, ok, "write_failed")
        self.now = target

    @rule(
        what=st.sampled_from(["done", "failure", "registration", "cancel", "hand_over", "restart"]),
        key=st.sampled_from([*KEYS, UNKNOWN]),
        rank=pick,
        producer=st.booleans(),
    )
    def disturb(self, what, key, rank, producer):
        """Rarer events, in one rule so they do not crowd out the common ones: a stranger's message,
        a second hand-over of a held key, an engine restart."""
        if what == "hand_over":
            self._duplicate_hand_over(rank)
        elif what == "restart":
            self._producer_engine_restarts() if producer else self._consumer_engine_restarts()
        else:
            self._stranger_sends(key, rank, what)

    @rule(
        what=st.sampled_from(["tp_not_dividing", "rank_outside", "no_shared_heads", "flood"]),
        key=st.sampled_from([*KEYS, UNKNOWN]),
        rank=pick,
    )
    def hostile(self, what, key, rank):
        """An admitted sender (claiming the real consumer or producer engine) sends what no honest
        peer would: a producer refuses it before any state changes and sends nothing; a consumer
        buffers a flood within its bounds."""
        if what == "flood":
            crank = rank % self.ctp
            for i in range(FLOOD):
                k = (f"flood-{i % 7}", 0) if i % 2 else key  # made-up keys, and ours from made-up ranks
                body = Done(*k, P_ENGINE, 10 + i) if i % 3 else Failure(*k, P_ENGINE, 10 + i, "made-up")
                self._consumer_did(crank, self.consumers[crank].notice(body, self.now))
            return
        prank = rank % self.ptp
        ctp, crank = {"tp_not_dividing": (3, 0), "rank_outside": (2, 5), "no_shared_heads": (self.ctp, -1)}[
            what
        ]
        if crank < 0:  # a consumer rank whose heads are not this producer rank's, if the TPs have one
            others = set(range(self.ctp)) - set(overlapping_ranks(HEADS, prank, self.ptp, self.ctp))
            if not others:
                return
            crank = min(others)
        core = self.producers[prank]
        before = repr((core.finished, core.parked, core.latest, core.ended, core.named))
        reg = Registration(*key, D_ENGINE, crank, ctp, "d", 5600, f"c{self.cgen}", TOKENS, [[0]],
                           deadline_unix=self.now + 5)  # fmt: skip
        out = core.registration(reg, self.now, self.now + 5)
        assert [type(a) for a in out] == [Reject], out
        assert repr((core.finished, core.parked, core.latest, core.ended, core.named)) == before

    def _duplicate_hand_over(self, prank):
        """A second hand-over of a held key (the worker refuses it; the core must too)."""
        prank %= self.ptp
        held = [k for (g, r, k), s in self.held.items() if (g, r) == (self.pgen, prank) and s == "held"]
        if held:
            key, core = held[0], self.producers[prank]
            entry = core.finished[key]
            out = core.prefill_finished(key, [[9]], TOKENS, D_ENGINE, self.now)
            assert core.finished.get(key) is entry, "a duplicate hand-over changed what is held"
            assert Reject in [type(a) for a in out] and not [a for a in out if isinstance(a, StartWrite)], out
            # A newer attempt existing, the duplicate's own blocks are freed at once; its first pass
            # may also end older attempts (bounded `latest` can forget them), like any hand-over.
            own = [a for a in out if isinstance(a, Release) and a.key == key]
            assert all(a.reason == "superseded" for a in own), own
            self._producer_did(prank, [a for a in out if a not in own])

    def _stranger_sends(self, key, rank, kind):
        """Another (admitted) engine names one of our keys, or anyone names an unknown key: no effect."""
        live = [k for _, k in self.recv]
        if key != UNKNOWN and live:  # rather a key in use
            key = live[rank % len(live)]
        engine = STRANGER if key != UNKNOWN else P_ENGINE if kind in ("done", "failure") else D_ENGINE
        if kind in ("done", "failure"):
            rank %= self.ptp
            body = Done(*key, engine, rank) if kind == "done" else Failure(*key, engine, rank, "forged")
            self.net.append(Msg("C", rank % self.ctp, body))
        elif kind == "registration" and key == UNKNOWN:  # a stranger's registration may park (DoS is
            # bounded by the TTL and max_entries; admission and revision checks are endpoint.py's)
            reg = Registration(*key, engine, 0, 1, "x", 1, "x", TOKENS, [[0]], deadline_unix=self.now + 5)
            self.net.append(Msg("P", rank % self.ptp, reg))
        elif kind == "cancel":
            self.net.append(Msg("P", rank % self.ptp, Cancel(*key, engine, rank % self.ctp)))

    def _producer_engine_restarts(self):
        """The producer engine dies (its WRITEs stop, its blocks and state go) and comes back empty."""
        self.pgen += 1
        self.producers = [self._producer(r) for r in range(self.ptp)]
        self.memory = [(set(), set()) for _ in range(self.ptp)]
        self.writes.clear()  # every WRITE reads a producer's memory: none survives it
        self.net = [m for m in self.net if m.to == "C"]  # sent before the crash: may still land

    def _consumer_engine_restarts(self):
        """The consumer engine dies and comes back: its receives are gone, WRITEs into it fail."""
        self.cgen += 1
        self.consumers = [self._consumer(r) for r in range(self.ctp)]
        for k, state in self.recv.items():
            if state == "waiting":
                self.recv[k] = "lost"
        self.net = [m for m in self.net if m.to == "P"]

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def maps_are_bounded(self):
        n = self.plimits.max_entries
        for p in self.producers:
            sizes = {
                "finished": len(p.finished),
                "parked": len(p.parked),
                "latest": len(p.latest),
                "ended": len(p.ended),
            }
            assert max(sizes.values()) <= n, sizes
            assert not {s[0] for s in p.parked} & set(p.finished), "a registration parked for a held key"
        for r, p in enumerate(self.producers):  # held by the model <=> held by the core
            held = {k for (g, pr, k), s in self.held.items() if (g, pr, s) == (self.pgen, r, "held")}
            assert held == set(p.finished), (held, set(p.finished))
        n = self.climits.max_entries
        for c in self.consumers:
            assert len(c.expected) <= n and len(c.early) <= n, (c.expected, c.early)
            # one notice per (engine, rank) for a key is all a peer can say; duplicates are not kept
            per_key, total = self.climits.max_notices_per_key, self.climits.max_early_notices
            assert all(len(v) <= per_key for v in c.early.values()), c.early
            assert c.early_notices == sum(len(v) for v in c.early.values()) <= total

    def teardown(self):
        """At the end of every run: deliver everything, finish every WRITE, let every clock run
        out; then every key has ended and every map is empty."""
        if not hasattr(self, "producers"):  # set-up did not run
            return
        horizon = self.max_deadline + abs(self.skew) + GRACE_S + WRITE_MAX_S
        ttl = max(self.plimits.lease_s, self.plimits.registration_ttl_s, self.climits.early_notice_ttl_s)
        horizon = max(horizon, self.now) + 2 * ttl
        for _ in range(10_000):
            if not (self.net or self.writes or self.now < horizon):
                break
            if self.net:  # a notice buffered now waits out its TTL before the maps must be empty
                horizon = max(horizon, self.now + 2 * self.climits.early_notice_ttl_s)
            while self.net:
                self._deliver(self.net.pop(0))
            for w in [w for w in self.writes if w.posted_at is None]:
                self._post(w, True)
            for w in self._posted():
                self._write_ends(w, True, "")
            self.tick(True)
            self.tick(False)
            if not self.net and not self.writes:
                self.now += 1.0
        else:
            raise AssertionError(f"never settled: {self.net} {self.writes}")
        for r, p in enumerate(self.producers):
            assert p.pending() == {"finished_blocks": 0, "registrations": 0, "inflight": 0}, (r, p.pending())
        for r, c in enumerate(self.consumers):
            want = {"receives": 0, "early_notices": 0, "quarantined": 0, "held": 0}
            assert c.pending() == want, (r, c.pending())
        assert "waiting" not in self.recv.values(), self.recv
        assert not [s for s, state in self.held.items() if s[0] == self.pgen and state == "held"], self.held
        unanswered = [s for s, n in self.reg_in.items() if s[0] == self.pgen and not self.answers.get(s)]
        assert not unanswered, f"registrations never answered: {unanswered}"


# ~6 s alone on one core. Derandomized: every run (CI too) tries the same examples, so a failure
# reproduces anywhere. Longer runs (more examples, derandomize=False) explore further; the focused
# tests below pin what such runs found.
Transfers.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_transfers = Transfers.TestCase


# ---- what the machine found (protocol.py fixed; one focused example each) ----------------------
KEY = ("r", 0)


def registration(rank=0, tp=1, engine=D_ENGINE):
    return Registration(*KEY, engine, rank, tp, "d", 5600, "c0", TOKENS, [[7]])


def producer(**limits):
    return ProducerCore(total_heads=HEADS, rank=0, tp_size=1, limits=Limits(**limits))


def writing(p, rank=0, tp=1):
    """`p` holds KEY's blocks and has started a WRITE to consumer rank `rank`."""
    p.prefill_finished(KEY, [[1]], TOKENS, D_ENGINE, now=0.0)
    (write,) = p.registration(registration(rank, tp), now=0.1, deadline=5.0)
    assert isinstance(write, StartWrite)
    return write


def test_a_write_that_fails_after_the_consumer_cancelled_is_answered_once():
    # was: cancel dropped the registration, then write_finished raised KeyError (endpoint thread down)
    p = producer()
    writing(p)
    assert p.cancel(KEY, D_ENGINE, 0, now=0.2) == []  # nothing before the WRITE ends
    out = p.write_finished(KEY, 0, False, "deadline", now=0.3)
    assert out == [SendFailure(registration(), "deadline"), Release(KEY, "failed")]


def test_a_failed_write_draws_one_failure_not_two():
    # was: [SendFailure(write_failed), SendFailure(transfer_failed), Release]
    p = producer()
    writing(p)
    out = p.write_finished(KEY, 0, False, "write_failed", now=0.2)
    assert out == [SendFailure(registration(), "write_failed"), Release(KEY, "failed")]


def test_a_cancel_after_the_kv_was_written_sends_no_failure():
    # was: SendFailure("cancelled") to a rank that had its Done, which could overtake the Done
    p = producer()
    writing(p, rank=0, tp=2)  # consumer rank 1 has not registered: the blocks stay held
    assert p.write_finished(KEY, 0, True, "", now=0.2) == []
    assert p.cancel(KEY, D_ENGINE, 0, now=0.3) == [Release(KEY, "failed")]


def test_only_the_engine_that_registered_cancels_a_parked_registration():
    # was: any engine's Cancel failed a parked registration (held blocks already checked the engine)
    p = producer()
    assert p.registration(registration(), now=0.0, deadline=5.0) == []
    out = p.cancel(KEY, STRANGER, 0, now=0.1)  # the stranger is told it has nothing here, no more
    assert out == [NothingInFlight(KEY, 0)] and p.pending()["registrations"] == 1
    assert p.cancel(KEY, D_ENGINE, 0, now=0.2) == [SendFailure(registration(), "cancelled")]
    # and the stranger's registration for the key it cancelled is refused, ours is not affected
    assert [type(a) for a in p.registration(registration(engine=STRANGER), now=0.3, deadline=5.0)] == [
        Reject,
        SendFailure,
    ]


def test_a_copy_of_a_registration_being_written_is_not_failed():
    # was: past the deadline (or once a newer attempt existed) the copy drew a Failure while the
    # WRITE ran, and the consumer could free its blocks under that WRITE
    p = producer()
    writing(p)
    late = p.registration(registration(), now=6.0, deadline=5.0)
    assert [(type(a), a.reason) for a in late] == [(Reject, "duplicate")]
    p.prefill_finished(("r", 1), [[2]], TOKENS, D_ENGINE, now=6.1)  # a newer attempt
    again = p.registration(registration(), now=6.2, deadline=5.0)
    assert [(type(a), a.reason) for a in again] == [(Reject, "duplicate")]


def test_a_copy_of_a_registration_failed_while_parked_is_not_written():
    # was: a registration dropped from `parked` (TTL or overflow) left no trace: a copy arriving later
    # parked again and was written once the prefill finished, into blocks the consumer had freed
    p = producer(registration_ttl_s=2.0)
    p.registration(registration(), now=0.0, deadline=10.0)
    assert [type(a) for a in p.tick(now=2.0)] == [Reject, SendFailure]
    copy = p.registration(registration(), now=2.5, deadline=10.0)
    assert copy[1:] == [SendFailure(registration(), "registration_expired")]
    assert p.prefill_finished(KEY, [[1]], TOKENS, D_ENGINE, now=3.0)[1:] == [
        Release(KEY, "registration_expired")
    ]

    p = producer(max_entries=1)
    p.registration(registration(), now=0.0, deadline=10.0)
    p.registration(Registration("b", 0, D_ENGINE, 0, 1, "d", 5600, "c0", TOKENS, [[7]]), now=0.1)  # evicts
    copy = p.registration(registration(), now=0.2, deadline=10.0)
    assert copy[1:] == [SendFailure(registration(), "producer_overloaded")]


def test_a_prefill_evicted_as_it_arrives_fails_its_parked_registrations():
    # was: KeyError in prefill_finished when the new entry itself was evicted (older ones writing)
    p = producer(max_entries=1)
    p.prefill_finished(("a", 0), [[1]], TOKENS, D_ENGINE, now=0.0)
    p.registration(Registration("a", 0, D_ENGINE, 0, 1, "d", 5600, "c0", TOKENS, [[7]]), now=0.1)
    assert p.registration(registration(), now=0.2) == []  # parked: KEY's prefill is still running
    out = p.prefill_finished(KEY, [[2]], TOKENS, D_ENGINE, now=0.3)
    assert out[1:] == [Release(KEY, "overflow"), SendFailure(registration(), "producer_overloaded")]


def test_evicting_held_blocks_fails_only_ranks_that_did_not_get_their_kv():
    # was: SendFailure("producer_overloaded") also to the rank whose WRITE had landed
    p = producer(max_entries=1)
    writing(p, rank=0, tp=2)
    p.write_finished(KEY, 0, True, "", now=0.2)
    out = p.prefill_finished(("b", 0), [[2]], TOKENS, D_ENGINE, now=0.3)
    assert [type(a) for a in out] == [Reject, Release] and out[1] == Release(KEY, "overflow")


def test_early_notices_keep_one_per_sender():
    # was: every copy was kept, so a repeating peer grew one key's list without bound for the TTL
    c = ConsumerCore(total_heads=HEADS, rank=0, tp_size=1, limits=Limits())
    assert c.notice(Done(*KEY, P_ENGINE, 0), now=0.0) == []
    for _ in range(3):
        assert [a.reason for a in c.notice(Done(*KEY, P_ENGINE, 0), now=0.1)] == ["duplicate"]
    assert len(c.early[KEY]) == 1
    assert c.expect(KEY, P_ENGINE, 1, deadline_s=5.0, now=0.2)[-1] == Received(KEY, 0.0)


def test_an_aborted_newer_attempt_releases_what_older_attempts_hold():
    # was: prefill_aborted only noted the attempt; attempt 0's held blocks waited for their lease
    p = producer()
    p.prefill_finished(KEY, [[1]], TOKENS, D_ENGINE, now=0.0)
    out = p.prefill_aborted(("r", 1), now=0.2)
    assert Release(KEY, "superseded") in out and KEY not in p.finished
    assert Release(("r", 1), "prefill_aborted") in out


def test_another_engine_registering_the_key_first_does_not_take_the_named_engines_slot():
    # was: parked slots were (key, rank): the named decode's registration was refused as a duplicate
    # and its request waited for its deadline; the other engine's was rejected at the prefill's end
    p = producer()
    assert p.registration(registration(engine="decode-other"), now=0.0) == []
    assert p.registration(registration(), now=0.1) == []  # parked too, in its own slot
    out = p.prefill_finished(KEY, [[1]], TOKENS, D_ENGINE, now=0.2)
    assert [type(a) for a in out] == [Reject, StartWrite] and out[0].reason == "unexpected_engine"
    assert out[1].reg.consumer_engine == D_ENGINE
