"""Consuming step: a decode rank's side of the endpoint thread (serving.py has the shared half).

Sends each expected receive's registration (or cancel) to its producer ranks (notify.py), checks a
sampled Done against the KV that landed (sentinel.py) before its core counts it, reports receives
that landed or failed, and probes the producer ranks of a receive held past its deadline.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from kvferry.connector import actions as A
from kvferry.connector import protocol as P
from kvferry.connector.kvcache import read_host
from kvferry.connector.layout import LayoutError
from kvferry.connector.metrics import failure_reason
from kvferry.connector.notify import Receive
from kvferry.connector.ratelimit import log_limited
from kvferry.connector.sentinel import digest, sample_tokens, shared_heads
from kvferry.connector.serving import Live, Serving
from kvferry.connector.wire import Done, Failure, Message
from kvferry.contracts.metrics import SAMPLE_MISMATCH

log = logging.getLogger(__name__)


class ConsumerSide(Serving):
    role = "consumer"

    def __init__(self, live: Live, core: P.ConsumerCore, receives: dict[A.Key, Receive]) -> None:
        """`receives`: where each receive the core accepted lands and from whom (Endpoint.expect
        adds them; this side drops them once settled)."""
        super().__init__(live)
        self.core, self.receives = core, receives

    def tick(self, now: float) -> list[A.Action]:
        return self.core.tick(now)

    def pending(self) -> dict[str, int]:
        return self.core.pending()

    # ---- messages ----
    def take(self, sender_agent: str, msg: Message, now: float) -> list[A.Action]:
        if not isinstance(msg, Done | Failure):  # intake admits only Done and Failure on a consumer
            return []
        if isinstance(msg, Done) and msg.sample and not self._sample_holds(msg):
            msg = Failure(msg.request_id, msg.attempt, msg.producer_engine, msg.producer_rank,
                          SAMPLE_MISMATCH, msg.revision)  # fmt: skip
        return self.core.notice(msg, now)

    def _sample_holds(self, done: Done) -> bool:
        """The sampled tokens' KV in our blocks is what the producer digested (sentinel.py)."""
        info = self.receives.get((done.request_id, done.attempt))
        if info is None:  # not expected (the core rejects it) or already settled
            return True
        _, _, blocks, first_token, num_tokens, producer_tp, _ = info
        tokens = sample_tokens(self.layout, done.request_id, done.attempt, first_token, num_tokens)
        heads = shared_heads(self.layout, done.producer_rank, producer_tp)
        try:
            ours = digest(self.layout, blocks, first_token, tokens, heads, read_host)
        except (LayoutError, ValueError):
            ours = "unreadable"
        ok = ours == done.sample
        self.metrics.record("sentinel", 1, "ok" if ok else "mismatch")
        if not ok:
            log_limited(log, logging.ERROR, "sample_mismatch",
                        "kvferry: KV of %s from %s rank %d is not what it sent (sampled tokens %s): "
                        "failing the receive", (done.request_id, done.attempt), done.producer_engine,
                        done.producer_rank, tokens)  # fmt: skip
        return ok

    # ---- actions ----
    def do_role(self, action: A.Action, now: float) -> None:
        if isinstance(action, A.Register | A.SendCancel):
            self._to_producers(action, now)
        elif isinstance(action, A.ProbeProducers):
            self._probe_producers(action)
        elif isinstance(action, A.Received):
            self.receives.pop(action.key, None)
            self.metrics.record("transfers", 1, self.role)
            self.metrics.record("receive_wait", action.wait_s)
            self.publish(lambda r: r.received.append(action.key))
        elif isinstance(action, A.Failed):
            self._failed(action)

    def _failed(self, action: A.Failed) -> None:
        self.receives.pop(action.key, None)
        self.metrics.record("failures", 1, self.role, action.reason)
        log_limited(log, logging.WARNING, ("failed", failure_reason(action.reason)),
                    "kvferry: receive of %s failed: %.80s", action.key, action.reason)  # fmt: skip
        self.publish(lambda r: r.failed.append((action.key, action.reason)))

    def settle_rejected(self, key: A.Key) -> None:
        self.receives.pop(key, None)
        self.publish(lambda r: r.failed.append((key, "rejected")))

    def _to_producers(self, action: A.Register | A.SendCancel, now: float) -> None:
        info, expected = self.receives.get(action.key), self.core.expected.get(action.key)
        if info is None or expected is None:
            return
        fail = partial(self._registration_failed, action.key, expected.producer_engine)
        self.notifier.to_producers(action, info, expected.producer_engine, expected.deadline, now, fail)

    def _registration_failed(self, key: A.Key, engine: str, rank: int, why: str) -> None:
        """Producer rank `rank` will never see our registration: count it as its Failure."""
        now = time.monotonic()
        self.feed(self.core.notice(Failure(key[0], key[1], engine, rank, why, self.cfg.revision), now), now)

    # ---- receives held past their deadline ----
    def _probe_producers(self, action: A.ProbeProducers) -> None:
        """A receive held past its deadline + grace: is each silent producer rank still there?
        Gone (nothing listens, or another incarnation does): unload its agent so nothing more of it
        lands, and let the core count it answered once the bytes on their way are in. Alive: cancel
        again (a lost Cancel, or one it had no registration for). Unknown: keep holding."""
        info, expected = self.receives.get(action.key), self.core.expected.get(action.key)
        if info is None or expected is None:
            return
        log_limited(log, logging.WARNING, "held", "kvferry: receive %s is held past its deadline: producer "
                    "%s ranks %s never answered; its blocks stay out of use until they do or are seen gone",
                    action.key, expected.producer_engine, list(action.producer_ranks))  # fmt: skip
        for rank in action.producer_ranks:
            then = partial(self._probed, action.key, rank)
            self.peers.probe(info[0], info[1] + rank, expected.producer_engine, then)

    def _probed(self, key: A.Key, rank: int, verdict: str, agent: str | None) -> None:
        now = time.monotonic()
        self.metrics.record("probes", 1, verdict)
        if verdict == "gone":
            self._forget_gone(key, rank, agent)
            self.feed(self.core.producer_gone(key, rank, now), now)
        elif verdict == "alive":
            self._to_producers(A.SendCancel(key, (rank,)), now)

    def _forget_gone(self, key: A.Key, rank: int, agent: str | None) -> None:
        if agent is not None and agent in self.transport.peers:
            try:
                self.transport.forget_peer(agent)
            except Exception as exc:  # a dead peer may refuse removal; drop it from our maps anyway
                log.debug("unloading gone peer agent %s: %s", agent, exc)
                self.transport.peers.pop(agent, None)
        info = self.receives.get(key)
        if info is not None:
            self.peers.forget_address(info[0], info[1] + rank)
