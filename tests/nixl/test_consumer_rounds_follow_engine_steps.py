"""With `consumer_rounds: step` the engine's steps run the consumer's rounds: a step's round_now() runs a
round that began after it asked, so the KV that landed before the step is taken by that step; between
steps the consumer's thread no longer polls on its own (it woke decode's core ~17 times per request).
Real producer and consumer endpoints and NIXL agents in this process; the KV is compared value by
value, the wake-ups come from the endpoint's own kvferry_endpoint_rounds metric."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kvferry.connector.config import KvferryConfig
from kvferry.connector.endpoint import Endpoint
from kvferry.tools.hostkv import CacheShape, host_kv

from tests.waiting import wait_until

pytestmark = pytest.mark.nixl

TOKENS, BLOCKS = 40, [3, 4, 5]
EXTRA = {"backends": ["UCX"], "side_channel_port": 0, "poll_max_s": 0.01, "idle_tick_s": 0.5}


def endpoint(role: str, engine: str, kv, **extra) -> Endpoint:
    cfg = KvferryConfig.from_extra({**EXTRA, **extra})
    return Endpoint(cfg, role=role, engine_id=engine, tp_rank=0, tp_size=1, layout=kv.layout).start()


def wake_ups(ep: Endpoint, seconds: float, step_every_s: float | None) -> tuple[int, int, int]:
    """Rounds the consumer ran over `seconds`, stepping it like an engine every `step_every_s` (None:
    no steps); the steps; and how many of them did not get their round within 2 ms."""
    start, steps, late, t_end = ep.rounds_run, 0, 0, time.monotonic() + seconds
    while time.monotonic() < t_end:
        if step_every_s is None:
            time.sleep(0.05)
            continue
        late += not ep.round_now(0.002)
        steps += 1
        time.sleep(step_every_s)
    return ep.rounds_run - start, steps, late


@pytest.mark.parametrize("consumer_rounds", ["step", "timer"])
def test_steps_run_the_consumers_rounds_and_take_the_kv_that_landed(consumer_rounds):
    p_kv, d_kv = host_kv(CacheShape(), 0), host_kv(CacheShape(), 0)
    p_kv.fill(BLOCKS, TOKENS)
    prod = endpoint("producer", "prefill-0", p_kv)
    cons = endpoint("consumer", "decode-0", d_kv, consumer_rounds=consumer_rounds)
    try:
        cons.expect("r", 0, producer_engine="prefill-0", producer_host="127.0.0.1",
                    producer_port=prod.side_port, producer_tp=1, block_ids=[BLOCKS], num_tokens=TOKENS,
                    deadline_s=20.0)  # fmt: skip
        wait_until(lambda: not cons.peers.fetching and cons.consumer.expected, "the handshake", 10, 0.01)
        # named in the OS too: its CPU is told apart from vLLM's worker thread (top -H, /proc)
        assert Path(f"/proc/self/task/{cons._thread.native_id}/comm").read_text().strip() == "kvferry-consume"
        # No engine steps (a demo, or an engine that stopped stepping): the receive is polled.
        self_polled, _, _ = wake_ups(cons, 1.0, None)
        assert self_polled >= 300, f"{self_polled} rounds in 1 s polling a pending receive"
        stepped, steps, late = wake_ups(cons, 1.0, 0.005)  # steps of 5 ms (a decode step on one core)
        if consumer_rounds == "step":
            assert late <= 2, f"{late} of {steps} steps did not get a round within 2 ms"
            # one round per step, none of its own between them
            assert stepped <= steps + 5, f"{stepped} rounds for {steps} steps"
        else:
            assert stepped > 1.2 * steps, f"timer polling ran {stepped} rounds beside {steps} kicks"
        prod.prefill_finished("r", 0, [BLOCKS], TOKENS, "decode-0")
        taken, t_end = [], time.monotonic() + 10
        while not taken and time.monotonic() < t_end:  # an engine stepping until its KV landed
            cons.round_now(0.002) if consumer_rounds == "step" else cons.kick()
            r = cons.take_results()
            assert not r.failed, r.failed
            taken = r.received
            time.sleep(0.005)
        assert taken == [("r", 0)]
        assert d_kv.mismatches(BLOCKS, TOKENS) == 0
    finally:
        cons.close()
        prod.close()
