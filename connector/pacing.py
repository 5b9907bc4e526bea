"""Pacing step: how long the endpoint thread sleeps between rounds, and what its rounds cost (pure).

Without a UCX progress thread a WRITE and its notification advance only when the agent is polled, so
the endpoint polls, at a rate set by what is pending: `poll_min_s` right after activity and while a
WRITE is in flight (short, on the critical path), backing off to ~8x that while receives or
handshakes are pending and to `poll_max_s` while anything else is (e.g. held blocks awaiting a
registration), and `idle_tick_s` with nothing pending at all. Idle, nothing that can arrive needs an
answer before a command wakes the thread anyway: a registration waits for its prefill to finish, a
notice for its expectation; the one exception, a peer completing its NIXL (UCX) connection after it
fetched our metadata, is covered by a polling window that the side channel opens (`connecting`).
A consumer whose engine steps run its rounds (`driven`, config `consumer_rounds: step`) polls on its
own only every `poll_max_s`, as a backstop: a Done notice read between two steps changes nothing
before the next step, and each wake-up in between preempts decode's forward pass on its core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvferry.connector.config import KvferryConfig
from kvferry.connector.metrics import Metrics

USAGE_EVERY_S = 1.0  # how often the thread's wake-ups and CPU time go to the metrics journal


@dataclass(frozen=True)
class Load:
    """What the endpoint has in hand after a round."""

    active: bool  # the round did something
    writing: bool  # a WRITE is in flight
    receiving: bool  # consumer: receives expected, or a handshake under way
    pending: bool  # anything at all in the protocol core's maps
    connecting: bool  # a peer fetched our metadata recently and may still be connecting
    driven: bool = False  # consumer: engine steps run its rounds; no handshake under way


def next_wait(cfg: KvferryConfig, load: Load, interval: float) -> float:
    """Seconds to sleep before the next round (commands and kicks wake the thread sooner)."""
    if load.writing:
        return cfg.poll_min_s
    if load.driven and not load.connecting:
        return cfg.poll_max_s
    if load.active:
        return cfg.poll_min_s
    if not (load.pending or load.receiving or load.connecting):
        return cfg.idle_tick_s
    cap = min(cfg.poll_min_s * 8, cfg.poll_max_s) if load.receiving else cfg.poll_max_s
    return min(interval * 2, cap)


class Usage:
    """Rounds and thread CPU time, recorded once a second (each record ships at the next engine step,
    so one per round would ship stats at every step)."""

    def __init__(self, metrics: Metrics, role: str) -> None:
        self.metrics, self.role = metrics, role
        self.rounds, self.since, self.cpu = 0, time.monotonic(), time.thread_time()

    def round(self) -> None:
        self.rounds += 1
        if time.monotonic() - self.since >= USAGE_EVERY_S:
            cpu = time.thread_time()
            self.metrics.record("endpoint_rounds", self.rounds, self.role)
            self.metrics.record("endpoint_cpu", cpu - self.cpu, self.role)
            self.rounds, self.since, self.cpu = 0, time.monotonic(), cpu
