"""Producing step: a prefill rank's side of the endpoint thread (serving.py has the shared half).

Takes consumers' registrations and cancels into its core (protocol.py), posts the WRITE of each
matched request once the consumer's agent is loaded (peers.py), watches posted WRITEs until NIXL
says they ended (writes.py), and answers every consumer it will not write, a consumer of another
revision included.
"""

from __future__ import annotations

import logging
import time

from kvferry.connector import actions as A
from kvferry.connector import protocol as P
from kvferry.connector.kvcache import read_host
from kvferry.connector.layout import LayoutError
from kvferry.connector.ratelimit import log_limited
from kvferry.connector.results import Results
from kvferry.connector.sentinel import digest, sample_tokens, sampled, shared_heads
from kvferry.connector.serving import Live, Serving
from kvferry.connector.wire import Cancel, Done, Failure, Message, Registration, decode, encode
from kvferry.connector.writes import Write
from kvferry.contracts.metrics import LAYOUT_MISMATCH

log = logging.getLogger(__name__)


class ProducerSide(Serving):
    role = "producer"

    def __init__(self, live: Live, core: P.ProducerCore) -> None:
        super().__init__(live)
        self.core = core

    def tick(self, now: float) -> list[A.Action]:
        return self.core.tick(now)

    def pending(self) -> dict[str, int]:
        return self.core.pending()

    # ---- messages ----
    def take(self, sender_agent: str, msg: Message, now: float) -> list[A.Action]:
        if isinstance(msg, Registration):
            # Wall clock across hosts (NTP-synced; the consumer's grace_s covers the skew), ours after.
            return self.core.registration(msg, now, now + msg.deadline_unix - time.time())
        if not isinstance(msg, Cancel):  # intake admits only Registration and Cancel on a producer
            return []
        key = (msg.request_id, msg.attempt)
        out = self.core.cancel(key, msg.consumer_engine, msg.consumer_rank, now)
        if any(isinstance(a, A.NothingInFlight) for a in out):
            # to the canceller's agent only (intake bound its rank to that agent's name)
            answer = Failure(*key, self.engine_id, self.tp_rank, "cancelled", self.cfg.revision)
            self.notifier.send(sender_agent, encode(answer), "")
        return [a for a in out if not isinstance(a, A.NothingInFlight)]

    def refused(self, sender_agent: str, raw: bytes, reject: A.Reject) -> None:
        """A consumer of another revision never gets KV from us, but always an answer: it holds its
        blocks until each producer rank answered or is gone. Unverified peers are reached only the
        bounded way (notify.py: a known agent, or one suspect handshake at a time)."""
        if reject.reason != "wrong_revision":
            return
        msg = decode(raw)  # admit() decoded it already: well-formed, bound to its sender's name
        if isinstance(msg, Registration):
            self.notifier.failure(msg, "wrong_revision", verified=False)
        elif isinstance(msg, Cancel):
            answer = Failure(msg.request_id, msg.attempt, self.engine_id, self.tp_rank, "wrong_revision",
                             self.cfg.revision)  # fmt: skip
            self.notifier.send(sender_agent, encode(answer), "")

    # ---- actions ----
    def do_role(self, action: A.Action, now: float) -> None:
        if isinstance(action, A.StartWrite):
            self.metrics.record("reg_to_match", action.registration_to_match_s)
            reg = action.reg
            self.peers.with_peer(
                reg.consumer_host,
                reg.consumer_port,
                reg.consumer_engine,
                reg.incarnation,
                lambda agent, err: self._start_write(action, agent, err),
            )
        elif isinstance(action, A.SendFailure):
            self.notifier.failure(action.reg, action.reason, action.verified)
        elif isinstance(action, A.Release):
            self._release(action)

    def _release(self, action: A.Release) -> None:
        def note(r: Results) -> None:
            if action.reason == "sent":
                r.sent.append(action.key)
            else:
                r.released.append((action.key, action.reason))

        self.publish(note)

    def settle_failed(self, action: A.Action, exc: Exception, now: float) -> None:
        if isinstance(action, A.StartWrite):
            self._write_failed(action.key, action.reg, "write_failed", now)
        else:
            super().settle_failed(action, exc, now)

    def settle_rejected(self, key: A.Key) -> None:
        self.publish(lambda r: r.released.append((key, "rejected")))

    def _write_failed(self, key: A.Key, reg: Registration, why: str, now: float) -> None:
        self.feed(self.core.write_finished(key, reg.consumer_rank, False, why, now), now)

    # ---- WRITEs ----
    def _start_write(self, action: A.StartWrite, agent: str | None, err: str) -> None:
        key, reg, now = action.key, action.reg, time.monotonic()
        if agent is None:
            self._write_failed(key, reg, "handshake_failed", now)
            return
        sample = self._sample_sent(key, action.block_ids, reg)
        notif = encode(
            Done(reg.request_id, reg.attempt, self.engine_id, self.tp_rank, self.cfg.revision, sample)
        )
        if now >= action.deadline:  # the handshake took us past the consumer's deadline
            self._write_failed(key, reg, "deadline", now)
            return
        try:
            if self.refusals(agent, consumer_side=False, registered=reg.layout_fingerprint):
                self._write_failed(key, reg, LAYOUT_MISMATCH, now)
                return
            handle, plan = self.transport.write(
                agent, action.block_ids, reg.block_ids, reg.num_tokens, notif,
                mode=self.cfg.descriptors, first_token=reg.first_token,
            )  # fmt: skip
        except Exception as exc:  # mapping, descriptors or NIXL: this WRITE fails, the thread serves on
            log_limited(log, logging.WARNING, "write_start", "kvferry: write of %s to %s failed to start: %s",
                        key, agent, exc)  # fmt: skip
            self._write_failed(key, reg, "write_failed", now)
            return
        self.metrics.record("descriptors", plan.descriptors, plan.mode)
        self.metrics.record("prep_seconds", plan.prep_s, plan.mode)
        must_end_by = action.deadline + self.cfg.grace_s / 2  # the consumer frees at deadline + grace_s
        self.writes.add(Write(key, reg.consumer_rank, agent, handle, now, plan, must_end_by))

    def _sample_sent(self, key: A.Key, blocks: list[list[int]], reg: Registration) -> str:
        """The digest a sampled request's Done carries ("" when not sampled; sentinel.py)."""
        if not sampled(key[0], key[1], self.cfg.sentinel_every):
            return ""
        tokens = sample_tokens(self.layout, key[0], key[1], reg.first_token, reg.num_tokens)
        heads = shared_heads(self.layout, reg.consumer_rank, reg.consumer_tp)
        try:
            return digest(self.layout, blocks, 0, tokens, heads, read_host)
        except (LayoutError, ValueError):
            return ""  # the mapping refuses the same blocks with its own reason

    def check_writes(self, now: float) -> list[A.Action]:
        out: list[A.Action] = []
        for o in self.writes.check(self.transport, now):
            w = o.write
            if o.ok:
                self.metrics.record("bytes", w.plan.nbytes, self.role, self.transport.backend)
                self.metrics.record("pushed_tokens", w.plan.tokens)
                self.metrics.record("pushed_blocks", w.plan.blocks)
                self.metrics.record("match_to_done", now - w.started)
                self.metrics.record("transfers", 1, self.role)
            out += self.core.write_finished(w.key, w.rank, o.ok, o.reason, now)
        return out
