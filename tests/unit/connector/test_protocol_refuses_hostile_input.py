"""protocol: what a hostile or careless peer sends is refused before it changes any state, costs O(1),
and never draws a Failure to an address nobody verified; P and D refuse other tokens or weights."""

from __future__ import annotations

import pytest
from kvferry.connector.actions import Failed, Reject, Release, SendFailure, StartWrite
from kvferry.connector.identity import model_digest, tokens_digest
from kvferry.connector.metrics import Metrics
from kvferry.connector.protocol import MAX_SLOTS_PER_KEY, TICK_BUDGET, ConsumerCore, Limits, ProducerCore
from kvferry.connector.wire import Done, Failure, Registration

HEADS, TOKENS, KEY = 4, 40, ("r", 0)
PROMPT = list(range(1000, 1000 + TOKENS))


def reg(rank=0, tp=1, engine="d0", key=KEY, tokens=TOKENS, digest="", model="", first=0):
    return Registration(*key, engine, rank, tp, "10.0.0.9", 5600, "c0", tokens, [[7]], "", "", 0.0, first,
                        digest, model)  # fmt: skip


def producer(identity="", **limits):
    return ProducerCore(total_heads=HEADS, rank=0, tp_size=1, limits=Limits(**limits), identity=identity)


def state(p):
    return (dict(p.finished), dict(p.parked), dict(p.latest), dict(p.ended), dict(p.named))


@pytest.mark.parametrize(
    ("rank", "tp", "why"),
    [(0, 3, "malformed"), (5, 2, "malformed"), (0, 0, "malformed"), (0, 8, "malformed")],
    ids=["tp-does-not-divide-heads", "rank-outside-tp", "tp-zero", "tp-over-heads"],
)
def test_a_registration_no_write_could_answer_is_refused_before_any_state_changes(rank, tp, why):
    p = producer()
    p.prefill_finished(("other", 0), [[1]], TOKENS, "d0", now=0.0)
    before = state(p)
    out = p.registration(reg(rank, tp), now=0.1, deadline=5.0)
    assert [(type(a), a.reason) for a in out] == [(Reject, why)]  # nothing sent to its address
    assert state(p) == before


def test_a_tp_that_does_not_divide_the_heads_cannot_lose_the_real_ranks_write():
    # was: the bad registration parked; prefill_finished raised LayoutError part-way through its
    # parked registrations: the real rank's WRITE was lost and the entry held forever
    p = producer()
    p.registration(reg(0, 3), now=0.0, deadline=5.0)
    assert p.registration(reg(), now=0.1, deadline=5.0) == []  # parked, waiting for the prefill
    out = p.prefill_finished(KEY, [[1]], TOKENS, "d0", now=0.2)
    assert [type(a) for a in out] == [StartWrite] and out[0].reg.consumer_tp == 1
    assert p.write_finished(KEY, 0, True, "", now=0.3) == [Release(KEY, "sent")]
    assert p.pending() == {"finished_blocks": 0, "registrations": 0, "inflight": 0}


def test_a_rank_sharing_no_heads_is_refused_without_a_failure():
    p = ProducerCore(total_heads=HEADS, rank=0, tp_size=2, limits=Limits())
    out = p.registration(reg(rank=1, tp=2), now=0.0, deadline=5.0)  # heads 2-3; ours are 0-1
    assert [(type(a), a.reason) for a in out] == [(Reject, "unexpected_rank")] and not p.parked


def test_failures_for_keys_our_prefill_never_named_are_not_verified():
    # was: a registration for a key prefill never saw (num_tokens 0, past its deadline, expiring)
    # drew a Failure sent to whatever host and port it named
    p = producer(registration_ttl_s=1.0)
    unknown = [
        p.registration(reg(key=("u1", 0), tokens=0), now=0.0),
        p.registration(reg(key=("u2", 0)), now=0.0, deadline=0.0),
    ]
    p.registration(reg(key=("u3", 0)), now=0.0, deadline=50.0)
    unknown.append(p.tick(now=2.0))
    sent = [a for out in unknown for a in out if isinstance(a, SendFailure)]
    assert [a.reason for a in sent] == ["token_mismatch", "deadline", "registration_expired"]
    assert not any(a.verified for a in sent)
    # the key our prefill named, for the engine it named: verified (the endpoint may handshake)
    p.prefill_finished(KEY, [[1]], TOKENS, "d0", now=3.0)
    (mine,) = [a for a in p.registration(reg(tokens=TOKENS + 1), now=3.1) if isinstance(a, SendFailure)]
    assert mine.verified and mine.reason == "token_mismatch"
    (other,) = [a for a in p.registration(reg(engine="d9", tokens=0), now=3.2) if isinstance(a, SendFailure)]
    assert not other.verified  # same key, another engine than the prefill named


def test_parked_registrations_of_one_key_are_bounded():
    p = producer()
    for i in range(MAX_SLOTS_PER_KEY + 10):
        p.registration(reg(engine=f"made-up-{i}"), now=0.0, deadline=5.0)
    assert len(p.parked) == MAX_SLOTS_PER_KEY


def test_consumer_tokens_and_weights_must_be_the_producers():
    model = model_digest({"model": "m", "dtype": "bfloat16"})
    p = producer(identity=model)
    p.prefill_finished(KEY, [[1]], TOKENS, "d0", now=0.0, token_ids=tuple(PROMPT))
    other_model = model_digest({"model": "m", "dtype": "float16"})
    out = p.registration(reg(digest=tokens_digest(PROMPT, TOKENS), model=other_model), now=0.1)
    assert [a.reason for a in out] == ["model_mismatch", "model_mismatch"]
    other_tokens = tokens_digest([*PROMPT[:-1], 7], TOKENS)  # same count, another last token
    out = p.registration(reg(digest=other_tokens, model=model), now=0.2)
    assert [a.reason for a in out] == ["token_mismatch", "token_mismatch"]
    # a consumer that registers fewer tokens (prefill kept one more) digests only those
    out = p.registration(
        reg(tokens=TOKENS - 1, digest=tokens_digest(PROMPT, TOKENS - 1), model=model), now=0.3
    )
    assert [type(a) for a in out] == [StartWrite]


def test_token_digests_need_the_tokens():
    assert tokens_digest(None, 5) == ""
    assert tokens_digest([1, 2, 3], 2) == tokens_digest([1, 2], 2) != tokens_digest([1, 3], 2)
    with pytest.raises(ValueError, match="2 token ids for 3 tokens"):
        tokens_digest([1, 2], 3)
    p = producer()
    out = p.prefill_finished(KEY, [[1]], TOKENS, "d0", now=0.0, token_ids=(1, 2))
    assert [type(a) for a in out] == [Reject, Release] and not p.finished


def consumer(**limits):
    return ConsumerCore(total_heads=HEADS, rank=0, tp_size=1, limits=Limits(**limits))


def test_a_flood_of_early_notices_is_bounded_in_total_and_per_key():
    # was: bounded by key only (any number of notices per key, from made-up ranks) with a linear scan
    c = consumer(max_entries=64, max_early_notices=256, max_notices_per_key=8)
    for i in range(20_000):
        key = (f"k{i % 100}", 0)
        msg = Done(*key, "p0", i) if i % 2 else Failure(*key, "p0", i, "x")
        c.notice(msg, now=0.0)
        assert c.early_notices == sum(len(v) for v in c.early.values()) <= 256
    assert len(c.early) <= 64 and max(len(v) for v in c.early.values()) <= 8
    assert all(a.reason == "unknown_request" for a in c.tick(now=100.0))
    assert c.pending() == {"receives": 0, "early_notices": 0, "quarantined": 0, "held": 0}
    assert c.early_notices == 0


def test_an_expectation_with_a_producer_tp_that_cannot_pair_fails_without_an_entry():
    c = consumer()
    out = c.expect(KEY, "p0", 3, deadline_s=5.0, now=0.0)
    assert [type(a) for a in out] == [Reject, Failed] and out[1].reason == "malformed"
    assert not c.expected


def test_a_failure_reason_chosen_by_a_peer_is_labelled_other():
    m = Metrics(journal=True)
    m.record("failures", 1, "consumer", "deadline")
    m.record("failures", 1, "consumer", "x" * 200)
    assert [labels for _, labels, _ in m.take_journal()] == [["consumer", "deadline"], ["consumer", "other"]]


def test_a_flood_that_expires_at_once_is_spread_over_rounds():
    p = producer(registration_ttl_s=1.0, max_entries=4096)
    for i in range(1000):
        p.registration(reg(key=(f"u{i}", 0)), now=0.0, deadline=2.0 if i % 2 else 50.0)
    rounds = []
    while p.parked:
        out = p.tick(now=5.0)
        rounds.append(sum(isinstance(a, SendFailure) for a in out))
    assert sum(rounds) == 1000 and max(rounds) <= 2 * TICK_BUDGET, rounds
    assert not p._deadlines  # no entry of an unparked slot left behind
