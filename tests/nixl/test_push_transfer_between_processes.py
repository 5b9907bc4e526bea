"""A real push transfer between processes leaves the consumer's KV equal to the producer's.

Different block sizes, TP sizes (heads split and merged) and in-block orders on each side; the
consumer reads through its own layout, every token, layer and head.
"""

from __future__ import annotations

import pytest
from kvferry.tools.hostkv import CacheShape

from tests.nixl.helpers import expect_args

pytestmark = pytest.mark.nixl


def blocks_for(tokens: int, block_size: int, first: int, reverse: bool = False) -> list[int]:
    ids = list(range(first, first + -(-tokens // block_size)))
    return ids[::-1] if reverse else ids


@pytest.mark.parametrize(
    ("p_shape", "d_shape", "tokens"),
    [
        # heads merged: 2 producer ranks (16-token head-major) -> 1 consumer rank (32-token token-major)
        (CacheShape(block_size=16, tp_size=2), CacheShape(block_size=32, order="token_major"), 301),
        # heads split: 1 producer rank (128) -> 2 consumer ranks (64), both vLLM-CPU layout
        (CacheShape(block_size=128, num_blocks=16), CacheShape(block_size=64, tp_size=2, num_blocks=32), 700),
        # one producer block into two consumer blocks, at and just below the block boundary
        (CacheShape(block_size=128, num_blocks=16), CacheShape(block_size=64, num_blocks=32), 128),
        (CacheShape(block_size=128, num_blocks=16), CacheShape(block_size=64, num_blocks=32), 127),
    ],
    ids=[
        "tp2-bs16-to-tp1-bs32",
        "tp1-bs128-to-tp2-bs64",
        "bs128-to-bs64-128-tokens",
        "bs128-to-bs64-127-tokens",
    ],
)
def test_consumer_kv_equals_producer_kv(procs, p_shape, d_shape, tokens):
    prods = procs.start("producer", "prefill-0", p_shape, ranks=p_shape.tp_size)
    cons = procs.start("consumer", "decode-0", d_shape, ranks=d_shape.tp_size)
    p_blocks = blocks_for(tokens, p_shape.block_size, 2)
    d_blocks = blocks_for(tokens, d_shape.block_size, 1, reverse=True)
    for c in cons:  # decode registers before prefill finishes (push-early)
        c.call("expect", "req-1", 0, expect_args(prods[0], d_blocks, tokens, tp=p_shape.tp_size))
    for p in prods:
        p.call("finish", "req-1", 0, p_blocks, tokens, "decode-0")
    for c in cons:
        assert c.call("results", 20.0, 1)["received"] == [("req-1", 0)]
        assert c.call("mismatches", d_blocks, tokens) == 0
    for p in prods:
        assert p.call("results", 10.0, 1)["sent"] == [("req-1", 0)]
    # and the other order, reusing the loaded peers and prepared state
    for p in prods:
        p.call("finish", "req-2", 0, p_blocks[::-1], tokens, "decode-0")
    for c in cons:
        c.call("expect", "req-2", 0, expect_args(prods[0], d_blocks[::-1], tokens, tp=p_shape.tp_size))
        assert c.call("results", 20.0, 1)["received"] == [("req-2", 0)]
        assert c.call("mismatches", d_blocks[::-1], tokens) == 0


@pytest.mark.parametrize("mode", ["prepped", "units"])
def test_same_layout_uses_prepped_lists_or_units_and_stays_exact(procs, mode):
    shape = CacheShape(block_size=16)
    (prod,) = procs.start("producer", "prefill-0", shape, descriptors=mode)
    (cons,) = procs.start("consumer", "decode-0", shape)
    cons.call("expect", "r", 0, expect_args(prod, [5, 6, 7, 9], 60))
    prod.call("finish", "r", 0, [1, 2, 3, 4], 60, "decode-0")
    assert cons.call("results", 20.0, 1)["received"] == [("r", 0)]
    assert cons.call("mismatches", [5, 6, 7, 9], 60) == 0
    # D may see the WRITE's notice before P polled it done (and counted its bytes): wait for P's result
    assert prod.call("results", 20.0, 1)["sent"] == [("r", 0)]
    text = prod.call("metrics")
    assert f'kvferry_descriptors_per_transfer_count{{mode="{mode}"}} 1.0' in text
    # bytes carry the backend that moved them; the start-up preflight names the backend it created
    assert 'kvferry_transfer_bytes_total{backend="UCX",role="producer"}' in text
    for p in (prod, cons):
        assert 'kvferry_preflight_ok{check="backend_UCX"} 1.0' in p.call("metrics")
