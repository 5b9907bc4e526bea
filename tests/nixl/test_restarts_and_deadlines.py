"""Peers that restart or stop answering, on real NIXL agents in separate processes.

- A producer restarted with the same engine id and side channel (new NIXL agent) is handshaken
  again transparently: the consumer's cached agent is stale, its send fails, it refetches and retries.
- A producer frozen (SIGSTOP) past the consumer's deadline + grace: the consumer holds its blocks (a
  visible leak, `kvferry_pending{kind="held"}`) and reports nothing, however long; when the producer
  resumes it answers the repeated Cancel, never writes after the deadline its registration carried,
  and only then does the consumer fail the receive.
- A producer frozen in the middle of a WRITE (UCX over TCP, so the WRITE needs the producer's
  progress) past the consumer's deadline + grace: the consumer holds its blocks, the resumed producer
  fences itself, and the consumer releases them only once the producer is gone (nothing listens at
  its side channel): what that WRITE moved landed before the release, and nothing lands after it.
  NIXL cannot stop a posted WRITE (releasing its handle or removing the peer does not), and on RDMA
  one lands without its producer's progress: no timer alone may hand the blocks back.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from kvferry.contracts import metrics as names
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.hostkv import CacheShape

from tests.nixl.helpers import expect_args, free_port_pair, parked_on
from tests.waiting import wait_until

pytestmark = pytest.mark.nixl
SHAPE = CacheShape(block_size=16)


def transfer(prod, cons, rid, blocks=(1, 2, 3), tokens=40):
    cons.call("expect", rid, 0, expect_args(prod, list(blocks), tokens))
    prod.call("finish", rid, 0, list(blocks), tokens, "decode-0")
    out = cons.call("results", 20.0, 1)
    assert prod.call("results", 20.0, 1)["sent"] == [(rid, 0)]
    return out


def test_a_restarted_producer_is_handshaken_again_and_no_request_fails(procs):
    port = free_port_pair()
    (prod,) = procs.start("producer", "prefill-0", SHAPE, side_channel_port=port)
    (cons,) = procs.start("consumer", "decode-0", SHAPE)
    assert transfer(prod, cons, "before")["received"] == [("before", 0)]  # D now caches P's agent
    prod.kill()
    (prod,) = procs.start("producer", "prefill-0", SHAPE, side_channel_port=port)  # same id and port
    out = transfer(prod, cons, "after", blocks=(4, 5, 6))
    assert out == {"sent": [], "released": [], "received": [("after", 0)], "failed": []}
    assert cons.call("mismatches", [4, 5, 6], 40) == 0
    handshakes = parse_metrics(cons.call("metrics"))
    assert metric_sum(handshakes, "kvferry_handshakes_total", result="retried") == 1
    assert metric_sum(handshakes, "kvferry_handshakes_total", result="ok") == 2


def held(cons) -> float:
    return metric_sum(parse_metrics(cons.call("metrics")), "kvferry_pending", kind="held")


def test_a_frozen_producer_never_writes_after_the_consumers_deadline(procs):
    (prod,) = procs.start("producer", "prefill-0", SHAPE)
    (cons,) = procs.start("consumer", "decode-0", SHAPE, grace_s=1.0)
    transfer(prod, cons, "warm")  # both agents loaded: no handshake in what follows
    blocks = [7, 8, 9]
    cons.call("expect", "r", 0, expect_args(prod, blocks, 40, deadline_s=2.0))
    parked_on(prod)
    os.kill(prod.pid, signal.SIGSTOP)
    try:
        # Past the deadline (2 s) + grace (1 s) and well beyond: P is frozen, not gone (its side
        # channel times out, nothing refuses it), so D holds the blocks and says so.
        assert cons.call("results", 6.0, 1)["failed"] == []
        assert held(cons) == 1
        finishing = threading.Thread(target=prod.call, args=("finish", "r", 0, [1, 2, 3], 40, "decode-0"))
        finishing.start()  # queued in the frozen process: it runs when P resumes
    finally:
        os.kill(prod.pid, signal.SIGCONT)
    # Resumed, P answers the Cancel (repeated while D holds): only then does D fail the receive.
    assert cons.call("results", 10.0, 1)["failed"] == [(("r", 0), "deadline")]
    assert held(cons) == 0
    finishing.join(30)
    released = prod.call("results", 10.0, 1)["released"]  # its blocks go back without a WRITE
    assert released and released[0][0] == ("r", 0), released
    assert metric_sum(parse_metrics(prod.call("metrics")), "kvferry_transfers_total") == 1  # warm only
    assert cons.call("mismatches", blocks, 40) > 0  # nothing landed in D's blocks
    probes = parse_metrics(cons.call("metrics"))
    assert metric_sum(probes, "kvferry_producer_probes_total", result="unknown") >= 1  # while frozen
    assert metric_sum(probes, "kvferry_producer_probes_total", result="gone") == 0
    # and P serves the next request as before
    assert transfer(prod, cons, "next", blocks=(4, 5, 6))["received"] == [("next", 0)]
    assert cons.call("mismatches", [4, 5, 6], 40) == 0


def posted(prod) -> float:
    """WRITEs the producer has posted so far."""
    return metric_sum(parse_metrics(prod.call("metrics")), f"{names.DESCRIPTORS_PER_TRANSFER}_count")


BIG = CacheShape(layers=8, heads=16, head_dim=128, num_blocks=72, block_size=16)  # 2 MiB a block


def test_a_write_stuck_past_the_consumers_deadline_holds_the_blocks_until_its_producer_is_gone(
    procs, monkeypatch
):
    monkeypatch.setenv("UCX_TLS", "tcp")  # a WRITE the producer's progress drives: it can stall
    (prod,) = procs.start("producer", "prefill-0", BIG, grace_s=1.0)
    (cons,) = procs.start("consumer", "decode-0", BIG, grace_s=1.0)
    transfer(prod, cons, "warm", blocks=(0,), tokens=16)  # both agents loaded: no handshake below
    blocks, tokens = list(range(8, 72)), 1024  # 128 MiB: a second or more through loopback TCP
    prod.call("finish", "r", 0, blocks, tokens, "decode-0")  # filling 128 MiB takes a while: first
    cons.call("expect", "r", 0, expect_args(prod, blocks, tokens, deadline_s=1.5))
    # Posted = its descriptors recorded (a count that only grows; the in-flight gauge can come and go
    # between two polls on a fast loopback, and then this wait never saw the WRITE).
    wait_until(lambda: posted(prod) == 2, "the WRITE to be posted", timeout_s=10, interval_s=0.005)
    os.kill(prod.pid, signal.SIGSTOP)
    try:
        # deadline 1.5 s + grace 1 s long past: the WRITE may still move, so the blocks stay held
        assert cons.call("results", 5.0, 1)["failed"] == [] and held(cons) == 1
    finally:
        os.kill(prod.pid, signal.SIGCONT)
    why = wait_until(lambda: prod.call("dead"), "the producer to fence itself", timeout_s=10, interval_s=0.05)
    assert why.startswith("StuckWrite:") and "('r', 0)" in why, why
    assert cons.call("results", 3.0, 1)["failed"] == []  # fenced is not gone: its agent still exists
    prod.kill()  # what a fenced engine does next: it fails, and its process (and connections) end
    assert cons.call("results", 15.0, 1)["failed"] == [(("r", 0), "deadline")]
    gone = metric_sum(parse_metrics(cons.call("metrics")), "kvferry_producer_probes_total", result="gone")
    assert gone == 1 and held(cons) == 0
    # Released now: whatever the WRITE moved landed before this; nothing may land after it.
    cons.call("clear", blocks, tokens)
    cleared = cons.call("mismatches", blocks, tokens)
    assert cleared > 0, cleared
    time.sleep(3.0)
    assert cons.call("mismatches", blocks, tokens) == cleared, "bytes landed in released blocks"
