"""protocol: rendezvous in either order, attempts, leases, deadlines, early notices, bounded maps."""

from __future__ import annotations

from kvferry.connector.actions import (
    Failed,
    NothingInFlight,
    ProbeProducers,
    Received,
    Register,
    Reject,
    Release,
    SendCancel,
    SendFailure,
    StartWrite,
)
from kvferry.connector.protocol import ConsumerCore, Limits, ProducerCore
from kvferry.connector.wire import Done, Failure, Registration

BLOCKS = [[1, 2, 3]]


def reg(rid="r", attempt=0, engine="d0", rank=0, tp=1):
    return Registration(rid, attempt, engine, rank, tp, "127.0.0.1", 5601, "inc", 40, [[7, 8, 9]])


def producer(**kw):
    return ProducerCore(total_heads=4, rank=0, tp_size=1, limits=Limits(**kw))


def kinds(actions):
    return [type(a).__name__ for a in actions]


def test_registration_first_then_prefill_starts_one_write():
    p = producer()
    assert p.registration(reg(), now=0.0) == []
    out = p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=1.5)
    assert kinds(out) == ["StartWrite"] and out[0].registration_to_match_s == 0.0
    assert p.write_finished(("r", 0), 0, True, "", now=2.0) == [Release(("r", 0), "sent")]
    assert p.pending() == {"finished_blocks": 0, "registrations": 0, "inflight": 0}


def test_prefill_first_then_registration_starts_one_write():
    p = producer()
    assert p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0) == []
    out = p.registration(reg(), now=0.25)
    assert isinstance(out[0], StartWrite) and out[0].registration_to_match_s == 0.25


def test_split_heads_waits_for_every_consumer_rank():
    p = producer()
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    for rank in (0, 1):
        assert kinds(p.registration(reg(rank=rank, tp=2), now=0.1)) == ["StartWrite"]
    assert p.write_finished(("r", 0), 0, True, "", now=0.2) == []
    assert p.write_finished(("r", 0), 1, True, "", now=0.2) == [Release(("r", 0), "sent")]


def test_old_attempt_never_matches_new_and_is_released():
    p = producer()
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    out = p.prefill_finished(("r", 1), BLOCKS, 40, "d0", now=1.0)
    assert Release(("r", 0), "superseded") in out
    late = p.registration(reg(attempt=0), now=1.1)
    assert kinds(late) == ["Reject", "SendFailure"] and late[0].reason == "superseded"
    assert kinds(p.registration(reg(attempt=1), now=1.2)) == ["StartWrite"]


def test_a_newer_prefill_fails_the_consumer_of_an_older_parked_registration():
    # Only the prefill's own attempts supersede: a registration naming a newer attempt parks beside
    # the older one (a peer's attempt number never releases or refuses what a prefill holds).
    p = producer()
    p.registration(reg(attempt=0), now=0.0)
    assert not [a for a in p.registration(reg(attempt=1), now=0.1) if isinstance(a, SendFailure)]
    out = p.prefill_finished(("r", 1), [[1]], 40, "d0", now=0.2)
    assert [a.reason for a in out if isinstance(a, SendFailure)] == ["superseded"]
    assert "StartWrite" in kinds(out)


def test_a_registration_naming_a_huge_attempt_supersedes_nothing():
    p = producer()
    p.prefill_finished(("r", 0), [[1]], 40, "d0", now=0.0)
    p.registration(reg(attempt=10**18), now=0.1)
    assert ("r", 0) in p.finished and kinds(p.registration(reg(attempt=0), now=0.2)) == ["StartWrite"]
    p2 = producer()
    p2.registration(reg(attempt=10**18), now=0.0)
    assert kinds(p2.prefill_finished(("r", 0), [[1]], 40, "d0", now=0.1)) == []  # held, not superseded


def test_duplicate_registration_is_rejected_not_acted_on():
    p = producer()
    p.registration(reg(), now=0.0)
    assert kinds(p.registration(reg(), now=0.1)) == ["Reject"]


def test_registration_from_an_engine_the_request_did_not_name_is_ignored():
    p = producer()
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    out = p.registration(reg(engine="intruder"), now=0.1)
    assert out == [Reject("unexpected_engine", out[0].detail)]


def test_lease_expiry_fails_registered_consumer_but_never_frees_blocks_under_a_write():
    p = producer(lease_s=1.0)
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    p.registration(reg(rank=0, tp=2), now=0.5)  # write to rank 0 in flight
    assert p.tick(now=5.0) == []  # held: a WRITE reads these blocks
    out = p.write_finished(("r", 0), 0, True, "", now=6.0)
    assert out == []  # rank 1 never registered; still leased until the next tick
    out = p.tick(now=7.0)
    assert out == [Release(("r", 0), "lease_expired")]


def test_lease_expiry_sends_failure_to_waiting_consumer():
    p = producer(lease_s=1.0)
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    p.registration(reg(rank=0, tp=2), now=0.1)
    p.write_finished(("r", 0), 0, False, "write_failed", now=0.2)
    assert ("r", 0) not in p.finished


def test_parked_registration_expires_with_a_failure_notice():
    p = producer(registration_ttl_s=2.0)
    p.registration(reg(), now=0.0)
    out = p.tick(now=2.0)
    assert kinds(out) == ["Reject", "SendFailure"] and out[1].reason == "registration_expired"
    assert p.pending()["registrations"] == 0


def test_parked_registrations_are_bounded():
    p = producer(max_entries=3)
    for i in range(5):
        p.registration(reg(rid=f"r{i}"), now=0.0)
    assert p.pending()["registrations"] == 3


def test_prefill_abort_fails_registered_consumers():
    p = producer()
    p.registration(reg(), now=0.0)
    out = p.prefill_aborted(("r", 0), now=0.1)
    assert SendFailure(reg(), "prefill_aborted") in out
    late = p.registration(reg(), now=0.2)
    assert [a.reason for a in late if isinstance(a, SendFailure)] == ["prefill_aborted"]


def test_write_failure_is_reported_to_the_consumer():
    p = producer()
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    p.registration(reg(), now=0.0)
    out = p.write_finished(("r", 0), 0, False, "write_failed", now=0.1)
    assert SendFailure(reg(), "write_failed") in out and Release(("r", 0), "failed") in out


# ---- consumer ----
def consumer(tp=1, rank=0, **kw):
    return ConsumerCore(total_heads=4, rank=rank, tp_size=tp, limits=Limits(**kw))


def done(rank=0, engine="p0", attempt=0):
    return Done("r", attempt, engine, rank)


def test_consumer_waits_for_every_producer_rank():
    c = consumer()
    out = c.expect(("r", 0), "p0", producer_tp=2, deadline_s=5, now=0.0)
    assert out == [Register(("r", 0), (0, 1))]
    assert c.notice(done(0), now=0.1) == []
    assert c.notice(done(1), now=0.3) == [Received(("r", 0), 0.3)]


def test_early_notice_is_buffered_not_dropped():
    c = consumer()
    assert c.notice(done(0), now=0.0) == []
    out = c.expect(("r", 0), "p0", producer_tp=1, deadline_s=5, now=0.1)
    assert out[-1] == Received(("r", 0), 0.0)


def test_deadline_cancels_producers_and_quarantines_blocks_until_they_answer():
    c = consumer(grace_s=2.0)
    c.expect(("r", 0), "p0", producer_tp=1, deadline_s=2, now=0.0)
    assert c.tick(now=1.9) == []
    # A WRITE posted just before the deadline may still land: the blocks are not handed back yet.
    assert c.tick(now=2.0) == [SendCancel(("r", 0), (0,))]
    assert c.pending()["quarantined"] == 1 and c.tick(now=3.0) == []
    assert c.notice(Failure("r", 0, "p0", 0, "cancelled"), now=3.1) == [Failed(("r", 0), "deadline")]
    assert c.pending()["receives"] == 0


def test_a_receive_no_producer_answers_is_held_never_released_on_a_timer():
    c = consumer(grace_s=2.0, probe_s=1.0, drain_s=0.5)
    c.expect(("r", 0), "p0", producer_tp=2, deadline_s=2, now=0.0)
    c.notice(done(0), now=1.0)
    assert c.tick(now=2.0) == [SendCancel(("r", 0), (1,))]
    assert c.tick(now=3.9) == []
    # Past deadline + grace, rank 1 is still silent: a WRITE from it may still land (on RDMA without
    # its producer's help), so the blocks stay held and the rank is probed, again and again.
    assert c.tick(now=4.0) == [ProbeProducers(("r", 0), (1,))] and c.pending()["held"] == 1
    assert c.tick(now=4.5) == [] and c.tick(now=5.0) == [ProbeProducers(("r", 0), (1,))]
    assert c.tick(now=3600.0) == [ProbeProducers(("r", 0), (1,))] and c.pending()["receives"] == 1


def test_a_gone_producer_counts_as_answered_once_its_bytes_drained():
    c = consumer(grace_s=2.0, probe_s=1.0, drain_s=0.5)
    c.expect(("r", 0), "p0", producer_tp=1, deadline_s=2, now=0.0)
    c.tick(now=2.0)
    assert c.tick(now=4.0) == [ProbeProducers(("r", 0), (0,))]
    assert c.producer_gone(("r", 0), 0, now=4.1) == []
    assert c.tick(now=4.5) == []  # not probed again: it is gone, its last bytes may still be landing
    assert c.tick(now=4.6) == [Failed(("r", 0), "deadline")]
    assert c.pending() == {"receives": 0, "early_notices": 0, "quarantined": 0, "held": 0}


def test_an_answer_to_a_repeated_cancel_releases_a_held_receive():
    c = consumer(grace_s=2.0)
    c.expect(("r", 0), "p0", producer_tp=1, deadline_s=2, now=0.0)
    c.tick(now=2.0)
    c.tick(now=4.0)
    assert c.notice(Failure("r", 0, "p0", 0, "cancelled"), now=4.2) == [Failed(("r", 0), "deadline")]
    assert c.pending()["held"] == 0


def test_held_receives_are_bounded_and_new_ones_refused_rather_than_blocks_reused():
    c = consumer(grace_s=1.0, max_held=1)
    c.expect(("a", 0), "p0", producer_tp=1, deadline_s=1, now=0.0)
    c.tick(now=1.0)
    c.tick(now=2.0)
    out = c.expect(("b", 0), "p0", producer_tp=1, deadline_s=5, now=2.1)
    assert kinds(out) == ["Reject", "Failed"] and out[1] == Failed(("b", 0), "held_full")
    c.notice(Failure("a", 0, "p0", 0, "cancelled"), now=2.2)  # the held one drains: room again
    assert kinds(c.expect(("b", 0), "p0", producer_tp=1, deadline_s=5, now=2.3)) == ["Register"]


def test_a_cancel_is_answered_for_every_rank_nothing_is_in_flight_to():
    p = producer()
    # a key we hold nothing of: answered, and that consumer's registration arriving later refused
    assert p.cancel(("r", 0), "d0", 0, now=0.0) == [NothingInFlight(("r", 0), 0)]
    assert kinds(p.registration(reg(), now=0.1)) == ["Reject", "SendFailure"]
    # and our prefill naming that consumer is freed at once
    assert kinds(p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.2)) == ["Reject", "Release"]
    # held, rank 1 not registered (its registration is on its way): answered; rank 0 writing: not
    p.prefill_finished(("s", 0), BLOCKS, 40, "d0", now=1.0)
    assert kinds(p.registration(reg("s", rank=0, tp=2), now=1.1)) == ["StartWrite"]
    assert p.cancel(("s", 0), "d0", 1, now=1.2) == [NothingInFlight(("s", 0), 1)]
    assert p.cancel(("s", 0), "d0", 0, now=1.3) == []  # its WRITE answers it
    assert kinds(p.registration(reg("s", rank=1, tp=2), now=1.4)) == ["SendFailure"]  # no WRITE


def test_kv_that_fully_lands_during_quarantine_is_received():
    c = consumer()
    c.expect(("r", 0), "p0", producer_tp=1, deadline_s=2, now=0.0)
    c.tick(now=2.0)
    assert c.notice(done(0), now=2.1) == [Received(("r", 0), 2.1)]


def test_no_write_starts_after_the_consumers_deadline():
    p = producer()
    assert p.registration(reg(), now=0.0, deadline=5.0) == []
    out = p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=6.0)
    assert kinds(out) == ["SendFailure", "Release"] and out[0].reason == "deadline"
    assert p.pending() == {"finished_blocks": 0, "registrations": 0, "inflight": 0}


def test_parked_registration_expires_at_the_consumers_deadline_not_the_ttl():
    p = producer(registration_ttl_s=60.0)
    p.registration(reg(), now=0.0, deadline=5.0)
    assert p.tick(now=4.9) == []
    out = p.tick(now=5.0)
    assert kinds(out) == ["SendFailure"] and out[0].reason == "deadline"


def test_registration_arriving_after_its_deadline_is_refused():
    p = producer()
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    out = p.registration(reg(), now=3.0, deadline=2.0)
    assert kinds(out) == ["Reject", "SendFailure"] and out[1].reason == "deadline"


def test_write_carries_the_deadline_so_the_endpoint_rechecks_it_before_posting():
    p = producer()
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    (write,) = p.registration(reg(), now=1.0, deadline=7.5)
    assert isinstance(write, StartWrite) and write.deadline == 7.5


def test_failure_notice_fails_fast():
    c = consumer()
    c.expect(("r", 0), "p0", producer_tp=1, deadline_s=30, now=0.0)
    assert c.notice(Failure("r", 0, "p0", 0, "lease_expired"), now=0.1) == [Failed(("r", 0), "lease_expired")]


def test_notice_from_unexpected_engine_or_attempt_is_not_counted():
    c = consumer()
    c.expect(("r", 1), "p0", producer_tp=1, deadline_s=30, now=0.0)
    assert kinds(c.notice(done(engine="intruder", attempt=1), now=0.1)) == ["Reject"]
    assert c.notice(done(attempt=0), now=0.1) == []  # old attempt: buffered, never matches attempt 1
    assert c.pending() == {"receives": 1, "early_notices": 1, "quarantined": 0, "held": 0}
    assert kinds(c.tick(now=100.0)) == ["SendCancel", "Reject"]
    assert kinds(c.tick(now=103.0)) == ["ProbeProducers"]  # only p0 can answer it, or be gone


def test_abort_waits_for_inflight_writes_then_reports_failure():
    c = consumer()
    c.expect(("r", 0), "p0", producer_tp=1, deadline_s=30, now=0.0)
    assert c.abort(("r", 0), now=0.1) == [SendCancel(("r", 0), (0,))]
    assert c.notice(done(0), now=0.2) == [Failed(("r", 0), "cancelled")]


def test_duplicate_done_is_rejected():
    c = consumer()
    c.expect(("r", 0), "p0", producer_tp=2, deadline_s=30, now=0.0)
    c.notice(done(0), now=0.1)
    assert kinds(c.notice(done(0), now=0.1)) == ["Reject"]


def test_consumer_asking_for_more_tokens_than_prefilled_fails_fast():
    p = producer()
    p.prefill_finished(("r", 0), BLOCKS, 30, "d0", now=0.0)
    out = p.registration(reg(), now=0.1)  # reg() asks for 40 tokens
    assert kinds(out) == ["Reject", "SendFailure"] and out[1].reason == "token_mismatch"


def test_a_prefill_that_finishes_after_the_consumer_cancelled_is_freed_at_once():
    p = producer(lease_s=30.0)
    p.registration(reg(), now=0.0, deadline=1.0)
    assert kinds(p.cancel(("r", 0), "d0", 0, now=1.0)) == ["SendFailure"]
    out = p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=2.0)
    assert kinds(out) == ["Reject", "Release"] and out[1] == Release(("r", 0), "cancelled")
    assert p.pending()["finished_blocks"] == 0  # not held for the 30 s lease


def test_a_registration_for_the_lacking_tokens_starts_a_write_of_those_tokens():
    p = producer()
    partial = Registration("r", 0, "d0", 0, 1, "127.0.0.1", 5601, "inc", 40, [[9]], first_token=32)
    p.prefill_finished(("r", 0), BLOCKS, 40, "d0", now=0.0)
    (write,) = p.registration(partial, now=0.1)
    # the prompt's blocks from token 0 on P; D's block list and the first token travel in the registration
    assert isinstance(write, StartWrite) and write.block_ids == BLOCKS and write.reg.first_token == 32


def test_a_registration_with_nothing_to_write_is_refused_and_answered():
    p = producer()
    empty = Registration("r", 0, "d0", 0, 1, "127.0.0.1", 5601, "inc", 40, [[9]], first_token=40)
    out = p.registration(empty, now=0.0)
    assert kinds(out) == ["Reject", "SendFailure"] and out[0].reason == "malformed"
    assert out[1].reason == "token_mismatch" and p.pending()["registrations"] == 0
