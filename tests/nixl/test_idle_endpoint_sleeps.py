"""An endpoint with nothing pending sleeps (`idle_tick_s`) instead of polling every `poll_max_s`: an
engine with no transfers shares its core with no one. A pending receive brings polling back, and a
command wakes the sleeping thread at once. Real endpoint and NIXL agent, in this process; the counts
come from the endpoint's own kvferry_endpoint_rounds metric."""

from __future__ import annotations

import socket
import time

import pytest
from kvferry.connector.config import KvferryConfig
from kvferry.connector.endpoint import Endpoint
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.hostkv import CacheShape, host_kv
from prometheus_client import generate_latest

from tests.waiting import wait_until

pytestmark = pytest.mark.nixl


def rounds(ep: Endpoint) -> float:
    text = generate_latest(ep.metrics.registry).decode()
    return metric_sum(parse_metrics(text), "kvferry_endpoint_rounds_total")


def test_idle_endpoint_sleeps_and_a_pending_receive_polls():
    kv = host_kv(CacheShape(), 0)
    extra = {"backends": ["UCX"], "side_channel_port": 0, "idle_tick_s": 0.5, "poll_max_s": 0.01}
    ep = Endpoint(KvferryConfig.from_extra(extra), role="consumer", engine_id="decode-0", tp_rank=0,
                  tp_size=1, layout=kv.layout).start()  # fmt: skip
    silent = None
    try:
        wait_until(lambda: rounds(ep), "the first usage flush", 30, 0.1)
        start, t0 = rounds(ep), time.monotonic()
        time.sleep(3.0)
        idle = (rounds(ep) - start) / (time.monotonic() - t0)
        assert idle <= 4, f"{idle:.0f} rounds/s with nothing pending (one per idle_tick_s expected)"
        # A receive from a producer whose side channel accepts and never answers: pending, so polled.
        silent = socket.create_server(("127.0.0.1", 0))
        ep.expect("r", 0, producer_engine="prefill-0", producer_host="127.0.0.1",
                  producer_port=silent.getsockname()[1], producer_tp=1, block_ids=[[1]], num_tokens=16,
                  deadline_s=60.0)  # fmt: skip
        # Polled every poll_max_s, 200 rounds take ~2 s; asleep (at most 4 rounds/s, as above) they
        # could not happen within the bound. A count awaited, not a rate: a busy host only slows it.
        start = rounds(ep)
        wait_until(
            lambda: rounds(ep) - start, "200 rounds with a receive pending", 20, 0.1, until=lambda n: n >= 200
        )
    finally:
        ep.close()
        if silent is not None:
            silent.close()
