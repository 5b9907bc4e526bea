"""Messages that are malformed, truncated, duplicated or from engines a side was not told about are
ignored and counted (kvferry_rejected_messages_total), never acted on, and the host keeps working."""

from __future__ import annotations

import contextlib
import re
import socket
import time

import pytest
from kvferry.connector.sidechannel import SideChannelServer, fetch_peer
from kvferry.connector.wire import Done, PeerInfo, Registration, encode
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.hostkv import CacheShape

from tests.nixl.helpers import expect_args
from tests.waiting import wait_until

pytestmark = pytest.mark.nixl
SHAPE = CacheShape(block_size=16)


@pytest.fixture
def rogue():
    """A real NIXL agent in this test process, posing as engine `decode-x`."""
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=False,
        capture_telemetry=False,
        num_threads=0,
        backends=["UCX"],
    )
    return nixl_agent("decode-x/0/rogue", cfg)


def pump(agent, seconds: float = 0.5) -> None:
    """Without a progress thread, a NIXL agent's sends advance only while it is polled."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        agent.get_new_notifs()
        time.sleep(0.001)


def rejected(metrics: str, reason: str) -> float:
    m = re.search(rf'kvferry_rejected_messages_total{{reason="{reason}",role="\w+"}} ([0-9.]+)', metrics)
    return float(m.group(1)) if m else 0.0


def wait_rejected(proc, reason: str, at_least: float) -> float:
    """The count of `reason` rejections once it reached `at_least` (callers check it is exact)."""
    return wait_until(
        lambda: rejected(proc.call("metrics"), reason),
        f"{at_least:g} {reason} rejections",
        timeout_s=60,
        interval_s=0.1,
        until=lambda n: n >= at_least,
    )


def reg(
    rid: str,
    engine: str,
    deadline_unix: float | None = None,
    *,
    rank: int = 0,
    port: int = 1,
    tokens: int = 40,
) -> Registration:
    """A registration as the rogue agent (`decode-x/0/rogue`) would send it: its own incarnation."""
    deadline = time.time() + 60.0 if deadline_unix is None else deadline_unix
    return Registration(
        rid, 0, engine, rank, 1, "127.0.0.1", port, "rogue", tokens, [[1, 2, 3]], "", "", deadline
    )


def test_producer_ignores_bad_registrations_and_keeps_working(procs, rogue):
    (prod,) = procs.start("producer", "prefill-0", SHAPE)
    (cons,) = procs.start("consumer", "decode-0", SHAPE)
    info = fetch_peer("127.0.0.1", prod.port, 5.0)
    name = rogue.add_remote_agent(info.agent_metadata)
    good = encode(reg("r1", "decode-x"))
    rogue.send_notif(name, good[: len(good) // 2])  # truncated
    rogue.send_notif(name, b"PUSH_REG:{}")  # foreign format
    rogue.send_notif(name, encode(reg("r2", "decode-0")))  # claims to be another engine
    rogue.send_notif(name, good)
    rogue.send_notif(name, good)  # duplicate
    rogue.send_notif(name, encode(reg("r3", "decode-x", deadline_unix=0.0)))  # without a deadline
    pump(rogue)
    assert wait_rejected(prod, "malformed", 3) == 3
    assert wait_rejected(prod, "unexpected_engine", 1) == 1
    assert wait_rejected(prod, "duplicate", 1) == 1
    # r1's prefill names decode-0, so decode-x's parked registration must never receive its KV
    prod.call("finish", "r1", 0, [4, 5, 6], 40, "decode-0")
    assert wait_rejected(prod, "unexpected_engine", 2) == 2
    cons.call("expect", "r1", 0, expect_args(prod, [7, 8, 9], 40))
    assert cons.call("results", 20.0, 1)["received"] == [("r1", 0)]
    assert cons.call("mismatches", [7, 8, 9], 40) == 0


def test_a_rank_speaks_only_for_itself_and_made_up_registrations_draw_one_handshake_at_most(procs, rogue):
    # was: the rank in a message was never checked against the sender's agent name, and every
    # registration for a key prefill never saw drew a handshake to the host and port it named
    (prod,) = procs.start("producer", "prefill-0", SHAPE)
    with contextlib.ExitStack() as stack:
        targets = [stack.enter_context(socket.create_server(("127.0.0.1", 0))) for _ in range(20)]
        name = rogue.add_remote_agent(fetch_peer("127.0.0.1", prod.port, 5.0).agent_metadata)
        rogue.send_notif(name, encode(reg("r0", "decode-x", rank=1)))  # rank 1 from agent rank 0
        for i, target in enumerate(targets):  # tokens [0, 0): each would draw a token_mismatch Failure
            rogue.send_notif(name, encode(reg(f"u{i}", "decode-x", port=target.getsockname()[1], tokens=0)))
        pump(rogue)
        assert wait_rejected(prod, "unexpected_rank", 1) == 1
        assert wait_rejected(prod, "malformed", 20) == 20
        # One suspect handshake at a time, each waiting out its timeout on a target that never
        # answers; the Failures that came meanwhile go nowhere. None reaches anyone (counted).
        assert wait_rejected(prod, "unverified_consumer", 20) == 20
        connected = 0
        for target in targets:
            target.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                target.accept()[0].close()
                connected += 1
        assert connected <= 2, connected  # (the old producer connected to all 20)


def test_a_peer_info_with_a_layout_past_every_bound_fails_one_write_and_nothing_else(procs, rogue):
    # was: layout_from_wire built planes x heads x block_size x head_dim offsets on the endpoint
    # thread (10^4 heads of 4,096 tokens x 4,096 dims: terabytes), the rank stalled or died
    (prod,) = procs.start("producer", "prefill-0", SHAPE)
    (cons,) = procs.start("consumer", "decode-0", SHAPE)
    honest = fetch_peer("127.0.0.1", cons.port, 5.0).layout
    huge = {**honest, "total_heads": 10_000, "num_heads": 10_000, "block_size": 4096, "head_dim": 4096}
    huge["planes"] = [[0, list(range(4096)), list(range(4096))]] * 2
    info = PeerInfo("decode-x", "decode-x/0/rogue", b"\0" * 64, 0, 1, "rogue", huge, "fp")
    fake = SideChannelServer("127.0.0.1", 0, encode(info))
    try:
        prod.call("finish", "r1", 0, [4, 5, 6], 40, "decode-x")
        name = rogue.add_remote_agent(fetch_peer("127.0.0.1", prod.port, 5.0).agent_metadata)
        rogue.send_notif(name, encode(reg("r1", "decode-x", port=fake.address[1])))
        pump(rogue)
        assert prod.call("results", 20.0, 1)["released"] == [(("r1", 0), "failed")]
        failed = metric_sum(parse_metrics(prod.call("metrics")), "kvferry_handshakes_total", result="failed")
        assert failed >= 1 and fake.stats.served >= 1  # it fetched, refused the layout, went on
    finally:
        fake.close()
    cons.call("expect", "r2", 0, expect_args(prod, [7, 8, 9], 40))  # the producer serves on
    prod.call("finish", "r2", 0, [1, 2, 3], 40, "decode-0")
    assert cons.call("results", 20.0, 1)["received"] == [("r2", 0)]


def test_consumer_ignores_completion_from_an_engine_it_did_not_ask(procs, rogue):
    (prod,) = procs.start("producer", "prefill-0", SHAPE)
    (cons,) = procs.start("consumer", "decode-0", SHAPE)
    cons.call("expect", "r", 0, expect_args(prod, [1, 2, 3], 40, deadline_s=15.0))
    name = rogue.add_remote_agent(fetch_peer("127.0.0.1", cons.port, 5.0).agent_metadata)
    rogue.send_notif(name, encode(Done("r", 0, "decode-x", 0)))  # a real sender, not the producer asked
    rogue.send_notif(name, encode(Done("r", 0, "prefill-0", 0)))  # spoofing the producer's name
    pump(rogue)
    assert wait_rejected(cons, "unexpected_engine", 2) == 2
    out = cons.call("results", 10.0, 1)
    assert out["received"] == [] and out["failed"] == [(("r", 0), "registration_expired")]


def test_engines_of_another_revision_are_rejected(procs, rogue):
    """A rollout's old decode and new prefill never exchange KV, even if something pairs them."""
    (prod,) = procs.start("producer", "prefill-0", SHAPE, revision="rev-new")
    (cons,) = procs.start("consumer", "decode-0", SHAPE, revision="rev-old")
    prod.call("finish", "r", 0, [4, 5, 6], 40, "decode-0")
    cons.call("expect", "r", 0, expect_args(prod, [7, 8, 9], 40, deadline_s=5.0))
    assert wait_rejected(prod, "wrong_revision", 1) == 1  # the old decode's registration
    out = cons.call("results", 15.0, 1)
    assert out["received"] == [] and [key for key, _ in out["failed"]] == [("r", 0)]
    # A notice that names itself truthfully but carries another revision is not counted either.
    name = rogue.add_remote_agent(fetch_peer("127.0.0.1", cons.port, 5.0).agent_metadata)
    rogue.send_notif(name, encode(Done("r2", 0, "decode-x", 0, "rev-new")))
    pump(rogue)
    assert wait_rejected(cons, "wrong_revision", 1) == 1
