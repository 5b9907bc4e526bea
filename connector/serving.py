"""Serving step: what a rank does with its live transport every round, whichever its role (endpoint thread).

The endpoint (endpoint.py) is the thread shell: commands in, results out, start and close, pacing.
Once its agent, side channel and notifier exist (`Endpoint._setup`), it creates one side for its
role on this base (producing.py, consuming.py) and runs every round through it, so transport,
notifier and protocol core are attributes a side always has, never Optional state of a thread that
may not have started yet. This base turns notifications into messages (intake.py), carries the
actions out that both roles share, and settles a request whose command or action failed; each role
adds the messages it takes and the actions only it gets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvferry.connector import actions as A
from kvferry.connector.config import KvferryConfig
from kvferry.connector.intake import admit
from kvferry.connector.layout import KVLayout, refusal
from kvferry.connector.metrics import Metrics
from kvferry.connector.notify import Notifier
from kvferry.connector.peers import Peers
from kvferry.connector.ratelimit import log_limited
from kvferry.connector.results import Results
from kvferry.connector.transport import NixlTransport
from kvferry.connector.wire import Message
from kvferry.connector.writes import InFlight

log = logging.getLogger(__name__)
Publish = Callable[[Callable[[Results], None]], None]  # Endpoint._publish: change the results, wake takers


class Refusals:
    """Why KV cannot move between this rank and a peer agent ("" when it can; layout.refusal), logged
    once per peer agent; counted per request by the caller's Failure."""

    def __init__(self, transport: NixlTransport, layout: KVLayout) -> None:
        self.transport, self.layout = transport, layout
        self._logged: set[str] = set()  # peer agents whose layout mismatch was logged

    def __call__(self, agent: str, *, consumer_side: bool, registered: str | None = None) -> str:
        peer = self.transport.peers[agent].layout
        src, dst = (peer, self.layout) if consumer_side else (self.layout, peer)
        why = refusal(src, dst, registered)
        if why and agent not in self._logged:
            self._logged.add(agent)
            log.error("kvferry: layout mismatch with %s, refusing every transfer: %s", agent, why)
        return why

    def of_producer(self, agent: str) -> str:
        """The consumer's check of a producer agent (the Notifier's `refusal`)."""
        return self(agent, consumer_side=True)

    def forget(self, agents: Iterable[str]) -> None:
        """Unloaded agents: a new one at their address is logged again."""
        self._logged -= set(agents)


@dataclass(frozen=True)
class Live:
    """What a serving rank works with, all of it there once the endpoint's `_setup` ran."""

    cfg: KvferryConfig
    engine_id: str
    tp_rank: int
    layout: KVLayout
    metrics: Metrics
    peers: Peers
    writes: InFlight
    transport: NixlTransport
    notifier: Notifier
    refusals: Refusals
    publish: Publish


class Serving:
    """The role-independent half of a serving rank; a subclass per role (producing.py, consuming.py)."""

    role = ""

    def __init__(self, live: Live) -> None:
        self.cfg, self.engine_id, self.tp_rank = live.cfg, live.engine_id, live.tp_rank
        self.layout, self.metrics, self.peers = live.layout, live.metrics, live.peers
        self.writes, self.publish, self.transport = live.writes, live.publish, live.transport
        self.notifier, self.refusals = live.notifier, live.refusals

    # ---- what each role adds ----
    def take(self, sender_agent: str, msg: Message, now: float) -> list[A.Action]:
        """A message intake admitted for this role."""
        raise NotImplementedError

    def refused(self, sender_agent: str, raw: bytes, reject: A.Reject) -> None:
        """A message intake refused (counted and logged by the Reject); a role may answer it."""

    def do_role(self, action: A.Action, now: float) -> None:
        raise NotImplementedError

    def settle_rejected(self, key: A.Key) -> None:
        """Tell the caller a request of theirs is over (its command could not be carried out)."""
        raise NotImplementedError

    def tick(self, now: float) -> list[A.Action]:
        raise NotImplementedError

    def pending(self) -> dict[str, int]:
        raise NotImplementedError

    def check_writes(self, now: float) -> list[A.Action]:
        """Posted WRITEs that ended (a producer's; a consumer posts none)."""
        return []

    # ---- notifications ----
    def read_notifs(self, now: float) -> list[A.Action]:
        # The round's first call that drives NIXL's progress: a stuck WRITE fences the rank before it.
        self.writes.fence(time.monotonic())
        out: list[A.Action] = []
        for sender, messages in self.transport.notifs().items():
            for raw in messages:
                try:
                    out += self._on_message(sender, raw, now)
                except Exception as exc:  # e.g. a registration whose TP cannot split the heads
                    out.append(A.Reject("invalid", f"from {sender}: {type(exc).__name__}: {exc}"))
        return out

    def _on_message(self, sender_agent: str, raw: bytes, now: float) -> list[A.Action]:
        msg = admit(raw, sender_agent, self.role, self.cfg.revision)
        if isinstance(msg, A.Reject):
            self.refused(sender_agent, raw, msg)
            return [msg]
        return self.take(sender_agent, msg, now)

    # ---- actions ----
    def carry_out(self, actions: list[A.Action], now: float) -> None:
        for action in actions:
            try:
                self.do(action, now)
            except Exception as exc:  # one action's failure settles its request, never the thread
                self.action_failed(action, exc, now)

    def feed(self, actions: list[A.Action], now: float) -> None:
        for action in actions:
            self.do(action, now)

    def do(self, action: A.Action, now: float) -> None:
        if not isinstance(action, A.Reject):
            self.do_role(action, now)
            return
        self.metrics.record("rejected", 1, self.role, action.reason)
        # A peer (or an attacker) decides how many of these come: never log more than one a key
        # per interval; the counter above counts every one.
        log_limited(log, logging.WARNING, ("reject", action.reason), "kvferry %s ignored input (%s): %s",
                    self.role, action.reason, action.detail)  # fmt: skip

    def action_failed(self, action: A.Action, exc: Exception, now: float) -> None:
        log.exception("kvferry %s: %s failed", self.role, type(action).__name__)
        self.settle_failed(action, exc, now)

    def settle_failed(self, action: A.Action, exc: Exception, now: float) -> None:
        key = getattr(action, "key", None)
        if key is not None:
            self.fail_key(key, f"{type(exc).__name__}: {exc}")

    def fail_key(self, key: A.Key, why: str) -> None:
        """Settle a request whose command could not be carried out: the caller gets an answer."""
        log_limited(
            log, logging.WARNING, "rejected", "kvferry %s: request %s failed: %s", self.role, key, why
        )
        self.metrics.record("failures", 1, self.role, "rejected")
        self.settle_rejected(key)
