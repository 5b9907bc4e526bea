"""intake: a notification is trusted only as far as its NIXL sender, revision and role allow; the
wire refuses deadlines that are not finite numbers; peer agents are unloaded as pods come and go."""

from __future__ import annotations

import time

import pytest
from kvferry.connector.actions import Reject
from kvferry.connector.config import KvferryConfig
from kvferry.connector.intake import admit
from kvferry.connector.metrics import Metrics
from kvferry.connector.peers import Peers
from kvferry.connector.wire import Cancel, Done, Failure, Registration, WireError, decode, encode


def registration(engine="decode-0", revision="r1", deadline=None):
    deadline = time.time() + 30 if deadline is None else deadline
    return Registration("q", 0, engine, 0, 1, "127.0.0.1", 5601, "a", 40, [[1]], revision, "fp", deadline)


def reason(result):
    return result.reason if isinstance(result, Reject) else None


def test_a_message_from_the_engine_it_claims_and_of_our_revision_is_admitted():
    msg = registration()
    assert admit(encode(msg), "decode-0/0/a", "producer", "r1") == msg
    done = Done("q", 0, "prefill/x", 3, "r1")  # an engine id may hold a slash
    assert admit(encode(done), "prefill/x/3/b", "consumer", "r1") == done


@pytest.mark.parametrize(
    ("raw", "sender", "role", "why"),
    [
        (b"KVF\x04garbage", "decode-0/0/a", "producer", "malformed"),
        (encode(registration(engine="decode-9")), "decode-0/0/a", "producer", "unexpected_engine"),
        (encode(registration(revision="r0")), "decode-0/0/a", "producer", "wrong_revision"),
        (encode(Done("q", 0, "prefill-0", 0, "r0")), "prefill-0/0/a", "consumer", "wrong_revision"),
        (encode(Cancel("q", 0, "decode-0", 0, "r0")), "decode-0/0/a", "producer", "wrong_revision"),
        (encode(Done("q", 0, "prefill-0", 0, "r1")), "prefill-0/0/a", "producer", "unexpected_message"),
        (encode(registration(deadline=0.0)), "decode-0/0/a", "producer", "malformed"),
        # a rank speaks only for itself: the rank in the message is the one in the agent name
        (encode(Done("q", 0, "prefill-0", 1, "r1")), "prefill-0/0/a", "consumer", "unexpected_rank"),
        (encode(Failure("q", 0, "prefill-0", 0, "x", "r1")), "prefill-0/2/a", "consumer", "unexpected_rank"),
        (encode(Cancel("q", 0, "decode-0", 1, "r1")), "decode-0/0/a", "producer", "unexpected_rank"),
        (encode(registration()), "decode-0/1/a", "producer", "unexpected_rank"),
        # a registration names the side channel of the agent that sent it (its incarnation)
        (encode(registration()), "decode-0/0/other", "producer", "unexpected_engine"),
        (encode(registration()), "decode-0", "producer", "unexpected_engine"),  # not an agent name
        (encode(registration()), "decode-0/x/a", "producer", "unexpected_engine"),
    ],
    ids=[
        "garbage",
        "impostor",
        "old-revision",
        "done-revision",
        "cancel-revision",
        "wrong-role",
        "no-deadline",
        "done-other-rank",
        "failure-other-rank",
        "cancel-other-rank",
        "registration-other-rank",
        "registration-other-incarnation",
        "no-agent-name",
        "agent-rank-not-a-number",
    ],
)
def test_untrusted_input_is_refused_with_a_reason(raw, sender, role, why):
    assert reason(admit(raw, sender, role, "r1")) == why


@pytest.mark.parametrize("deadline", [float("inf"), float("nan"), -float("inf")])
def test_a_deadline_that_is_not_a_finite_number_is_a_wire_error(deadline):
    with pytest.raises(WireError, match="deadline_unix: must be finite"):
        decode(encode(registration(deadline=deadline)))


class FakeTransport:
    """Only the two members Peers.prune uses (pure bookkeeping; NIXL itself is in tests/nixl)."""

    def __init__(self, *agents: str) -> None:
        self.peers = {a: object() for a in agents}
        self.forgotten: list[str] = []

    def forget_peer(self, agent: str) -> None:
        self.forgotten.append(agent)
        del self.peers[agent]


def peers_knowing(*entries: tuple[tuple[str, int], str, float]) -> Peers:
    p = Peers(KvferryConfig(peer_idle_s=60.0), Metrics(), lambda: None)
    for addr, agent, used in entries:
        p._known[addr] = ("inc", agent)
        p._used[addr] = used
    return p


def test_prune_unloads_replaced_and_idle_agents_but_never_one_a_write_uses():
    peers = peers_knowing((("10.0.0.1", 5600), "p-a/0/new", 100.0), (("10.0.0.2", 5600), "p-b/0/x", 10.0))
    transport = FakeTransport("p-a/0/old", "p-a/0/new", "p-b/0/x", "p-c/0/gone")
    # p-a's old agent was replaced by a restart; p-b is idle for 90 s; p-c was forgotten but is busy.
    assert sorted(peers.prune(transport, busy={"p-c/0/gone"}, now=100.0)) == ["p-a/0/old", "p-b/0/x"]
    assert set(transport.peers) == {"p-a/0/new", "p-c/0/gone"}
    assert peers.prune(transport, busy=set(), now=101.0) == ["p-c/0/gone"]
    peers.close()


def test_an_idle_peer_with_a_write_in_flight_stays_loaded():
    peers = peers_knowing((("10.0.0.2", 5600), "p-b/0/x", 0.0))
    transport = FakeTransport("p-b/0/x")
    assert peers.prune(transport, busy={"p-b/0/x"}, now=1000.0) == []
    assert "p-b/0/x" in transport.peers
    peers.close()


def test_a_failure_of_another_revision_is_admitted_it_carries_no_kv():
    # A consumer holds its blocks until each producer rank answers: a producer of another revision
    # (a rollout) refuses to exchange KV, and its Failure must still reach the consumer.
    msg = admit(
        encode(Failure("q", 0, "prefill-0", 0, "wrong_revision", "r0")), "prefill-0/0/a", "consumer", "r1"
    )
    assert isinstance(msg, Failure) and msg.reason == "wrong_revision"
    # still bound to its sender's name
    forged = admit(encode(Failure("q", 0, "prefill-0", 0, "x", "r0")), "prefill-9/0/a", "consumer", "r1")
    assert reason(forged) == "unexpected_engine"
