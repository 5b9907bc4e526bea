"""Every fault yields a logged reason and a reported failure: never a crash of the host, never a hang."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.hostkv import CacheShape

from tests.nixl.helpers import expect_args, parked_on

pytestmark = pytest.mark.nixl
SHAPE = CacheShape(block_size=16)
BLOCKS = [1, 2, 3]


def pair(procs, **extra):
    (prod,) = procs.start("producer", "prefill-0", SHAPE, **extra)
    (cons,) = procs.start("consumer", "decode-0", SHAPE, **extra)
    return prod, cons


def assert_still_works(prod, cons, rid="after"):
    """The host processes keep serving: a fresh request transfers exactly."""
    cons.call("expect", rid, 0, expect_args(prod, [9, 10, 11], 40))
    prod.call("finish", rid, 0, [4, 5, 6], 40, "decode-0")
    assert cons.call("results", 20.0, 1)["received"] == [(rid, 0)]
    assert cons.call("mismatches", [9, 10, 11], 40) == 0


def failed_within(cons, seconds):
    t0 = time.monotonic()
    out = cons.call("results", seconds + 5.0, 1)
    return out["failed"], time.monotonic() - t0


def test_lease_expiry_fails_a_late_consumer_fast(procs):
    prod, cons = pair(procs)
    prod.call("finish", "r", 0, BLOCKS, 40, "decode-0")
    assert prod.call("results", 10.0, 1)["released"] == [(("r", 0), "lease_expired")]
    cons.call("expect", "r", 0, expect_args(prod, BLOCKS, 40, deadline_s=30.0))
    failed, took = failed_within(cons, 5.0)
    assert failed == [(("r", 0), "lease_expired")] and took < 10.0  # far before the 30 s deadline
    assert_still_works(prod, cons)


def test_unknown_request_registration_expires_with_failure(procs):
    prod, cons = pair(procs)
    cons.call("expect", "never-prefilled", 0, expect_args(prod, BLOCKS, 40, deadline_s=30.0))
    failed, took = failed_within(cons, 5.0)
    assert failed == [(("never-prefilled", 0), "registration_expired")] and took < 10.0


def test_prefill_abort_fails_the_consumer_fast(procs):
    prod, cons = pair(procs)
    cons.call("expect", "r", 0, expect_args(prod, BLOCKS, 40, deadline_s=30.0))
    parked_on(prod)  # the registration arrives first
    prod.call("abort", "r", 0)
    failed, _ = failed_within(cons, 5.0)
    assert failed == [(("r", 0), "prefill_aborted")]


def test_superseded_attempt_never_matches_and_new_attempt_works(procs):
    prod, cons = pair(procs)
    prod.call("finish", "r", 1, BLOCKS, 40, "decode-0")
    cons.call("expect", "r", 0, expect_args(prod, [7, 8, 9], 40, deadline_s=30.0))
    assert failed_within(cons, 5.0)[0] == [(("r", 0), "superseded")]
    cons.call("expect", "r", 1, expect_args(prod, [7, 8, 9], 40))
    assert cons.call("results", 20.0, 1)["received"] == [("r", 1)]
    assert cons.call("mismatches", [7, 8, 9], 40) == 0


def test_block_ids_out_of_range_fail_the_write_not_the_process(procs):
    prod, cons = pair(procs)
    cons.call("expect", "r", 0, expect_args(prod, [1, 2, SHAPE.num_blocks + 5], 40, deadline_s=30.0))
    prod.call("finish", "r", 0, BLOCKS, 40, "decode-0")
    assert failed_within(cons, 5.0)[0] == [(("r", 0), "write_failed")]
    assert prod.call("results", 5.0, 1)["released"] == [(("r", 0), "failed")]
    assert_still_works(prod, cons)


def test_layouts_that_cannot_be_mapped_are_refused_before_any_write(procs):
    """D checks P's layout before registering: no registration, no WRITE, a reason on both counts."""
    (prod,) = procs.start("producer", "prefill-0", SHAPE)
    (cons,) = procs.start("consumer", "decode-0", CacheShape(block_size=16, head_dim=32))
    cons.call("expect", "r", 0, expect_args(prod, BLOCKS, 40, deadline_s=30.0))
    prod.call("finish", "r", 0, BLOCKS, 40, "decode-0")
    assert failed_within(cons, 5.0)[0] == [(("r", 0), "layout_mismatch")]
    metric = 'kvferry_transfer_failures_total{reason="layout_mismatch",role="consumer"} 1.0'
    assert metric in cons.call("metrics")
    assert cons.call("mismatches", BLOCKS, 40) > 0  # nothing was written into the consumer's blocks
    assert prod.call("results", 10.0, 1)["released"] == [(("r", 0), "lease_expired")]  # never registered
    assert metric_sum(parse_metrics(prod.call("metrics")), "kvferry_transfer_bytes_total") == 0


def test_a_request_the_core_cannot_accept_fails_alone_and_the_thread_serves_on(procs):
    """A producer TP of 3 cannot split 4 KV heads: that request fails with a reason (it used to end
    the endpoint thread, leaving every later request of the engine waiting); the core refuses it
    before it holds anything (malformed), it does not raise."""
    prod, cons = pair(procs)
    cons.call("expect", "bad-tp", 0, expect_args(prod, BLOCKS, 40, tp=3))
    assert failed_within(cons, 5.0)[0] == [(("bad-tp", 0), "malformed")]
    assert 'kvferry_transfer_failures_total{reason="malformed",role="consumer"} 1.0' in cons.call("metrics")
    assert_still_works(prod, cons)


def test_producer_killed_turns_into_a_deadline_failure(procs):
    prod, cons = pair(procs)
    cons.call("expect", "r", 0, expect_args(prod, BLOCKS, 40, deadline_s=3.0))
    parked_on(prod)
    prod.kill()
    failed, took = failed_within(cons, 3.0)
    assert failed == [(("r", 0), "deadline")] and took < 8.0


def test_consumer_killed_mid_transfer_releases_producer_blocks(procs):
    big = CacheShape(block_size=128, num_blocks=64, layers=4, heads=8, head_dim=128)  # 32 MiB per request
    slow = {"lease_s": 20.0, "registration_ttl_s": 20.0}  # a busy box may take seconds per step
    (prod,) = procs.start("producer", "prefill-0", big, **slow)
    (cons,) = procs.start("consumer", "decode-0", big, **slow)
    (other,) = procs.start("consumer", "decode-1", big, **slow)
    tokens, blocks = 128 * 32, list(range(32))
    cons.call("expect", "r", 0, expect_args(prod, blocks, tokens))
    parked_on(prod)
    prod.call("finish", "r", 0, blocks, tokens, "decode-0", False)  # contents do not matter here
    cons.kill()  # while the WRITE is posted or in flight
    out = prod.call("results", 30.0, 1)  # bounded: the WRITE completes or fails, blocks are released
    assert out["sent"] == [("r", 0)] or out["released"] == [(("r", 0), "failed")], out
    other.call("expect", "r2", 0, expect_args(prod, blocks, tokens))
    prod.call("finish", "r2", 0, blocks, tokens, "decode-1", False)
    assert other.call("results", 30.0, 1)["received"] == [("r2", 0)]


def test_producer_side_channel_that_never_answers_fails_fast(procs):
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_hold():  # accepts, reads nothing, answers nothing
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    t = threading.Thread(target=accept_and_hold, daemon=True)
    t.start()
    try:
        (cons,) = procs.start("consumer", "decode-0", SHAPE)
        args = dict(expect_args(cons, BLOCKS, 40, deadline_s=30.0), producer_port=silent.getsockname()[1])
        cons.call("expect", "r", 0, args)
        failed, took = failed_within(cons, 8.0)
        assert failed == [(("r", 0), "handshake_failed")] and took < 12.0
    finally:
        stop.set()
        silent.close()
        t.join(2)
        for s in held:
            s.close()
