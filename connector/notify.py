"""Notify step: the notifications a rank sends its peers' agents (endpoint thread).

A consumer rank sends its registration, or a cancel, to each producer rank whose heads it shares; a
producer rank sends a Failure to a consumer rank it will not write (a Done rides on the WRITE itself,
writes.py). Each goes to the peer's agent, fetched once from its side channel (peers.py); a send that
fails is retried once after a fetch (`Notifier.deliver`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

from kvferry.connector.actions import Register, SendCancel
from kvferry.connector.config import KvferryConfig
from kvferry.connector.metrics import Metrics
from kvferry.connector.peers import Peers
from kvferry.connector.ratelimit import log_limited
from kvferry.connector.transport import NixlTransport
from kvferry.connector.wire import Cancel, Failure, PeerInfo, Registration, encode
from kvferry.contracts.metrics import LAYOUT_MISMATCH

log = logging.getLogger(__name__)
# producer host, port; blocks, first token, end token; producer TP size; digest of the prompt's tokens
Receive = tuple[str, int, list[list[int]], int, int, int, str]


class Notifier:
    def __init__(
        self,
        cfg: KvferryConfig,
        transport: NixlTransport,
        peers: Peers,
        metrics: Metrics,
        *,
        me: PeerInfo,  # this rank, as its side channel serves it
        side_port: int,
        role: str,
        refusal: Callable[[str], str],  # why this rank refuses a producer agent's layout ("" if not)
        model_digest: str = "",  # identity.model_digest of our weights, sent in every registration
    ) -> None:
        self.model_digest = model_digest
        self.cfg, self.transport, self.peers, self.metrics = cfg, transport, peers, metrics
        self.me, self.side_port, self.role, self._refusal = me, side_port, role, refusal

    def failure(self, reg: Registration, reason: str, verified: bool = True) -> None:
        """Producer: tell the consumer rank of `reg` that it will not get this KV, and why. Unless
        `verified` (protocol.py: our prefill named its key and engine) the address is only what a
        registration claims: the Failure goes to an agent already loaded for that address and
        incarnation, or through a `suspect` handshake (one at a time, on its own thread: peers.py),
        else nowhere (counted; a real consumer ends the receive at its own deadline). Either way
        only to the very agent that sent `reg` (the fetch checks engine and incarnation)."""
        known = self.peers.known(reg.consumer_host, reg.consumer_port, reg.incarnation)
        msg = encode(
            Failure(
                reg.request_id,
                reg.attempt,
                self.me.engine_id,
                self.me.tp_rank,
                reason,
                self.cfg.revision,
            )
        )

        def then(agent: str | None, err: str) -> None:
            if agent is None and not verified:
                self.metrics.record("rejected", 1, self.role, "unverified_consumer")
                return
            self.metrics.record("failures", 1, self.role, reason)
            self.send(agent, msg, err)

        if known is not None:
            then(known, "")
            return
        self.peers.with_peer(
            reg.consumer_host, reg.consumer_port, reg.consumer_engine, reg.incarnation, then,
            suspect=not verified,
        )  # fmt: skip

    def to_producers(
        self,
        action: Register | SendCancel,
        info: Receive,
        producer_engine: str,
        deadline: float,
        now: float,
        registration_failed: Callable[[int, str], None],
    ) -> None:
        """Consumer: the registration (or cancel) of `action.key` to each of its producer ranks.
        `deadline` is the receive's, on the monotonic clock of `now`; `registration_failed(rank, why)`
        when a producer rank will never see its registration."""
        host, port, blocks, first_token, num_tokens, _, digest = info
        rid, attempt = action.key
        for rank in action.producer_ranks:
            if isinstance(action, SendCancel):
                cancel = Cancel(rid, attempt, self.me.engine_id, self.me.tp_rank, self.cfg.revision)
                self.deliver(host, port + rank, producer_engine, encode(cancel), None)
                continue
            deadline_unix = time.time() + deadline - now
            reg = Registration(
                rid, attempt, self.me.engine_id, self.me.tp_rank, self.me.tp_size, self.cfg.side_channel_host,
                self.side_port, self.me.incarnation, num_tokens, blocks, self.cfg.revision,
                self.me.layout_fingerprint, deadline_unix, first_token, digest, self.model_digest,
            )  # fmt: skip
            fail = partial(registration_failed, rank)
            self.deliver(host, port + rank, producer_engine, encode(reg), fail)

    def deliver(
        self, host: str, port: int, engine: str, payload: bytes, failed: Callable[[str], None] | None,
        retried: bool = False,
    ) -> None:  # fmt: skip
        """Send to the producer rank at host:port. A send to a cached agent that fails means the peer
        restarted (same engine id, new agent) or its connection broke: fetch it again and retry once,
        so a restart never fails a request that can still be served. `failed(why)` on failure; a
        registration is never sent to a rank whose layout we would refuse."""

        def then(agent: str | None, err: str) -> None:
            if agent is not None and failed is not None and self._refusal(agent):
                failed(LAYOUT_MISMATCH)
            elif not self.send(agent, payload, err):
                if agent is not None and not retried:
                    self.metrics.record("handshakes", 1, "retried")
                    self.deliver(host, port, engine, payload, failed, retried=True)
                elif failed is not None:
                    failed("handshake_failed")

        self.peers.with_peer(host, port, engine, None, then)

    def send(self, agent: str | None, payload: bytes, err: str) -> bool:
        if agent is None:
            log_limited(log, logging.WARNING, "notify", "kvferry: cannot notify a peer: %s", err)
            return False
        try:
            self.transport.send(agent, payload)
            return True
        except Exception as exc:  # a dead or replaced peer: forget it so the next use refetches
            log_limited(log, logging.WARNING, "notify", "kvferry: notification to %s failed: %s", agent, exc)
            self.peers.forget(agent)
            return False
