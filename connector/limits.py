"""Limits step: the bounds of the protocol cores' maps and timers (protocol.py, consumer.py). Pure."""

from __future__ import annotations

from dataclasses import dataclass

# Expiries one tick carries out per map: a flood that expires all at once is spread over the next
# rounds (each a few ms apart) instead of making one round late by thousands of Failures.
TICK_BUDGET = 256


@dataclass(frozen=True)
class Limits:
    lease_s: float = 30.0  # producer: how long finished blocks wait for a registration
    registration_ttl_s: float = 60.0  # producer: how long a registration waits for its prefill
    early_notice_ttl_s: float = 60.0  # consumer: how long a notice waits for its expectation
    max_entries: int = 4096  # per map
    # consumer: past the deadline the outstanding producer ranks are cancelled and get grace_s to
    # answer; after that their side channels are probed every probe_s until each has answered or is
    # seen gone (nothing listens there, or another incarnation does), then drain_s more for bytes
    # already on their way. The blocks are never released on a timer alone: a WRITE cannot be
    # stopped, and on RDMA a posted one lands without its producer's help.
    grace_s: float = 2.0
    probe_s: float = 1.0
    drain_s: float = 0.5
    # consumer: receives held past deadline + grace_s (their blocks a visible leak); beyond it this
    # rank takes no new receive until one drains
    max_held: int = 256
    # consumer: notices buffered before their expectation, in all and per key (one per producer
    # engine and rank is all an honest peer sends; a flood beyond either bound is dropped, counted)
    max_early_notices: int = 8192
    max_notices_per_key: int = 64


DEFAULT_LIMITS = Limits()
