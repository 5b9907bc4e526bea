"""A decode that already holds a prompt's first blocks (its own prefix-cache hit) registers only the
blocks it lacks, and a real NIXL push writes exactly those tokens: read through the consumer's own
layout, every lacking token equals the producer's, and every held token is untouched (still zero
here: a WRITE of the whole prompt, or of a block more, would have filled them).

Same layout on both sides (prepped descriptor lists: whole pages from the first lacking block), and
a first token inside a larger producer block with the heads split over two consumer ranks
(coalesced element ranges).
"""

from __future__ import annotations

import pytest
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.hostkv import CacheShape

from tests.nixl.helpers import expect_args

pytestmark = pytest.mark.nixl


def per_token(shape: CacheShape, ranks: int) -> int:
    """Elements of one token on one rank: layers x K,V x the rank's heads x head_dim."""
    return shape.layers * 2 * (shape.heads // ranks) * shape.head_dim


@pytest.mark.parametrize(
    ("p_shape", "d_shape", "tokens", "held", "mode"),
    [
        (CacheShape(block_size=16), CacheShape(block_size=16), 60, 32, "prepped"),
        (
            CacheShape(block_size=64),
            CacheShape(block_size=16, tp_size=2, order="token_major"),
            150,
            48,
            "coalesced",
        ),
    ],
    ids=["same-layout-prepped", "first-token-inside-a-P-block-tp1-to-tp2"],
)
def test_only_the_lacking_tokens_are_written(procs, p_shape, d_shape, tokens, held, mode):
    (prod,) = procs.start("producer", "prefill-0", p_shape)
    cons = procs.start("consumer", "decode-0", d_shape, ranks=d_shape.tp_size)
    p_blocks = list(range(3, 3 + -(-tokens // p_shape.block_size)))
    d_blocks = list(range(20, 20 + -(-tokens // d_shape.block_size)))[::-1]  # D's, from token 0
    lacking = d_blocks[held // d_shape.block_size :]
    for c in cons:
        c.call("expect", "req-1", 0, {**expect_args(prod, lacking, tokens), "first_token": held})
    prod.call("finish", "req-1", 0, p_blocks, tokens, "decode-0")
    for c in cons:
        assert c.call("results", 20.0, 1)["received"] == [("req-1", 0)]
        # the held tokens' elements (zero) are exactly the ones that differ from the producer's
        assert c.call("mismatches", d_blocks, tokens) == held * per_token(d_shape, d_shape.tp_size)
    assert prod.call("results", 20.0, 1)["sent"] == [("req-1", 0)]
    m = parse_metrics(prod.call("metrics"))
    assert metric_sum(m, "kvferry_descriptors_per_transfer_count", mode=mode) == d_shape.tp_size
    assert metric_sum(m, "kvferry_pushed_tokens_total") == (tokens - held) * d_shape.tp_size
    lacking_blocks = -(-tokens // d_shape.block_size) - held // d_shape.block_size
    assert metric_sum(m, "kvferry_pushed_blocks_total") == lacking_blocks * d_shape.tp_size
    if mode == "coalesced":  # element ranges: exactly the lacking tokens' bytes
        assert metric_sum(m, "kvferry_transfer_bytes_total") == (tokens - held) * per_token(d_shape, 1) * 4


def test_a_first_token_off_the_consumers_block_is_refused_before_registering(procs):
    """Never a partial write: the consumer fails the request at once, naming why."""
    (prod,) = procs.start("producer", "prefill-0", CacheShape(block_size=16))
    (cons,) = procs.start("consumer", "decode-0", CacheShape(block_size=16))
    cons.call("expect", "req-1", 0, {**expect_args(prod, [7, 8], 60), "first_token": 30})
    assert cons.call("results", 10.0, 1)["failed"] == [(("req-1", 0), "rejected")]
    m = parse_metrics(prod.call("metrics"))
    assert metric_sum(m, "kvferry_pending", kind="registrations") == 0
