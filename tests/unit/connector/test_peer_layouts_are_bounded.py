"""wire and peers: every number of a peer's layout is bounded by name before anything is built from
it, and handshakes in flight are bounded (callers beyond the bound are answered at once)."""

from __future__ import annotations

import tracemalloc

import pytest
from kvferry.connector import wire
from kvferry.connector.config import KvferryConfig
from kvferry.connector.metrics import Metrics
from kvferry.connector.peers import MAX_FETCHES, Peers
from kvferry.connector.wire import WireError, layout_from_wire, layout_to_wire
from kvferry.tools.hostkv import synthetic_layout

LAYOUT = synthetic_layout(
    "head_major", bases=[1 << 20], num_blocks=4, block_size=16, num_heads=2, head_dim=8, elem_bytes=4
)
WIRE = layout_to_wire(LAYOUT)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"total_heads": 10_000, "num_heads": 10_000}, "peer.layout.num_heads: must be <= 1024"),
        ({"block_size": 100_000}, "peer.layout.block_size: must be <= 8192"),
        ({"head_dim": 100_000}, "peer.layout.head_dim: must be <= 4096"),
        ({"planes": [[0, [0], [0]]] * 3}, "peer.layout.planes: must be of length <= 2"),
        ({"regions": [[4096, 1, 0]] * (wire.MAX_REGIONS + 1)}, "peer.layout.regions: must be of length"),
        ({"windows": [0] * (wire.MAX_GROUPS + 1)}, "peer.layout.windows: must be of length"),
        ({"elem_bytes": 1 << 40}, "peer.layout.elem_bytes: must be <= 16"),
        # each within its bound, the product is not: refused before KVLayout builds the offsets
        (
            {"total_heads": 1024, "num_heads": 1024, "block_size": 4096, "head_dim": 4096},
            "2 planes x 1024 heads x 4096 tokens x 4096 dims",
        ),
    ],
    ids=["heads", "block-size", "head-dim", "planes", "regions", "windows", "elem-bytes", "product"],
)
def test_a_layout_out_of_bounds_is_refused_by_name_without_allocating(change, named):
    # was: a PeerInfo with 10^4 heads built planes x heads x block_size x head_dim offsets (~2.6 GB)
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match=named.replace("(", r"\(")):
            layout_from_wire({**WIRE, **change})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # the inputs themselves, not anything built from them


def test_the_side_channel_reads_at_most_what_those_bounds_allow():
    assert wire.MAX_PEER_INFO < 8 << 20  # was 64 MiB
    assert layout_from_wire(WIRE, LAYOUT.fingerprint) == LAYOUT


def test_handshakes_in_flight_are_bounded_and_the_rest_answered_at_once():
    # A fetch stays in flight until the endpoint thread finishes it (Peers.finish), never called here.
    peers = Peers(KvferryConfig(handshake_timeout_s=1.0), Metrics(), lambda: None)
    answered: list[tuple[str | None, str]] = []
    try:
        for i in range(MAX_FETCHES + 5):
            peers.with_peer("127.0.0.1", 1 + i, None, None, lambda a, e: answered.append((a, e)))
        assert peers.fetching == MAX_FETCHES
        assert len(answered) == 5 and all(a is None and "already under way" in e for a, e in answered)
    finally:
        peers.close()
