"""The CR's transfer token, end to end with real NIXL: P and D holding it transfer as before; a client
or a decode rank without it (or with another CR's) never gets prefill's agent metadata.

Each rank process reads KVFERRY_TRANSFER_TOKEN_FILE from the environment it was spawned with, as the
operator's pods do from their mounted Secret.
"""

from __future__ import annotations

import pytest
from kvferry.connector.sideauth import SideAuth
from kvferry.connector.sidechannel import SideChannelError, fetch_peer
from kvferry.contracts import pods
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.hostkv import CacheShape

from tests.nixl.helpers import expect_args
from tests.waiting import wait_until

pytestmark = pytest.mark.nixl
TOKEN = "dG9rZW4tb2YtdGhpcy1jci0zMi1ieXRlcy1sb25nLWVub3VnaA=="
SHAPE = CacheShape(block_size=16, num_blocks=8)


def _metric(proc, name: str, **labels: str) -> float:
    return metric_sum(parse_metrics(proc.call("metrics")), name, **labels)


def test_ranks_with_the_token_transfer_and_nothing_without_it_gets_metadata(procs, tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    monkeypatch.setenv(pods.TRANSFER_TOKEN_ENV, str(token))
    (prod,) = procs.start("producer", "prefill-0", SHAPE)
    (cons,) = procs.start("consumer", "decode-0", SHAPE)
    assert _metric(prod, "kvferry_transfer_auth", mode="token") == 1
    assert _metric(cons, "kvferry_transfer_auth", mode="token") == 1

    cons.call("expect", "req-1", 0, expect_args(prod, [3, 4], 20))
    prod.call("finish", "req-1", 0, [5, 6], 20, "decode-0")
    assert cons.call("results", 20.0, 1)["received"] == [("req-1", 0)]
    assert cons.call("mismatches", [3, 4], 20) == 0

    info = fetch_peer("127.0.0.1", prod.port, 2.0, SideAuth(TOKEN.encode()), "tool")
    assert info.engine_id == "prefill-0"
    with pytest.raises(SideChannelError, match=pods.TRANSFER_TOKEN_ENV):
        fetch_peer("127.0.0.1", prod.port, 2.0)  # no token
    with pytest.raises(SideChannelError, match="proof was refused"):
        fetch_peer("127.0.0.1", prod.port, 2.0, SideAuth(b"another-cr-token-0123456789"), "x")
    wait_until(
        lambda: _metric(prod, "kvferry_side_channel_auth_failures_total", reason="bad_proof"),
        "the wrong proof counted",
        timeout_s=5,
        interval_s=0.1,
        until=lambda n: n == 1,
    )

    # A decode rank of another CR (another token) is refused metadata: its receive fails, nothing lands.
    other = tmp_path / "other"
    other.write_text("b3RoZXItY3ItdG9rZW4tMzItYnl0ZXMtbG9uZy1lbm91Z2g=\n")
    monkeypatch.setenv(pods.TRANSFER_TOKEN_ENV, str(other))
    (stranger,) = procs.start("consumer", "decode-1", SHAPE)
    stranger.call("expect", "req-2", 0, expect_args(prod, [1, 2], 20, deadline_s=8.0))
    failed = stranger.call("results", 15.0, 1)["failed"]
    assert [key for key, *_ in failed] == [("req-2", 0)], failed
    assert _metric(stranger, "kvferry_handshakes_total", result="failed") >= 1
    assert _metric(prod, "kvferry_side_channel_auth_failures_total", reason="bad_proof") >= 2
