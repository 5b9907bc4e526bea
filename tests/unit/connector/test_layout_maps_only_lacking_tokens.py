"""mapping.plan with a first token: a decode that already holds the first k tokens of a prompt (its own
prefix-cache hit, whole consumer blocks) lists only the blocks it lacks, and the producer writes
exactly tokens [k, n): every one of them element by element, none before, whatever each side's block
size (k may fall inside a producer block), TP split and packing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.connector.layout import LayoutError
from kvferry.connector.mapping import block_table, coalesce, plan, pushed_blocks, token_runs
from kvsim import KINDS, apply, buffer_for, expected, fill, gather, make_layout
from test_layout_maps_every_token import shared

HELD = np.int32(-7)  # what the consumer's held prefix blocks contain: must survive the transfer


@st.composite
def prefix_case(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    p_tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0]))
    d_tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0]))
    dims = draw(st.sampled_from([1, 2, 4]))
    common = dict(layers=draw(st.integers(1, 2)), num_blocks=48, heads=heads, head_dim=dims)
    src = make_layout(draw(st.sampled_from(KINDS)), block_size=draw(st.sampled_from([2, 4, 8, 16, 32])),
                      tp_rank=draw(st.integers(0, p_tp - 1)), tp_size=p_tp, **common)  # fmt: skip
    d_rank = draw(st.integers(0, d_tp - 1))
    d_heads = range(d_rank * heads // d_tp, (d_rank + 1) * heads // d_tp)
    if d_heads.start >= src.heads().stop or src.heads().start >= d_heads.stop:  # must share a head
        d_rank = src.head_offset * d_tp // heads
    dst = make_layout(draw(st.sampled_from(KINDS)), block_size=draw(st.sampled_from([2, 4, 8, 16, 32])),
                      tp_rank=d_rank, tp_size=d_tp, **common)  # fmt: skip
    n = draw(st.integers(2, 90))
    held_blocks = draw(st.integers(1, (n - 1) // dst.block_size)) if n > dst.block_size else 0
    s_blocks = draw(st.permutations(range(48)))[: -(-n // src.block_size)]
    d_blocks = draw(st.permutations(range(48)))[: -(-n // dst.block_size)]
    return src, s_blocks, dst, d_blocks, n, held_blocks * dst.block_size


@settings(max_examples=120, deadline=None)
@given(prefix_case(), st.booleans())
def test_only_the_tokens_decode_lacks_are_written_and_each_exactly(case, merge):
    src, s_blocks, dst, d_blocks, n, first = case
    s_buf, d_buf = buffer_for(src), buffer_for(dst)
    fill(s_buf, src, s_blocks, n)
    d_buf.view(np.int32)[:] = HELD  # the held prefix (and everything else) before the transfer
    lacking = d_blocks[first // dst.block_size :]
    seg = plan(src, [s_blocks], dst, [lacking], n, first_token=first, merge=merge)
    apply(coalesce(seg), s_buf, d_buf)
    s_heads, d_heads = shared(src, dst)
    got = gather(d_buf, dst, d_blocks, n)[:, :, d_heads]
    want = expected(src, n)[:, :, s_heads]
    np.testing.assert_array_equal(got[:, :, :, first:], want[:, :, :, first:])  # what D lacked arrived
    assert (got[:, :, :, :first] == HELD).all()  # the held prefix was not written
    # exactly the lacking tokens' shared elements: neither the whole prompt nor a block more or less
    assert seg.total_bytes == want[:, :, :, first:].size * 4
    written = d_buf.view(np.int32) != HELD
    assert written.sum() * 4 == seg.total_bytes


def test_a_hit_inside_a_producer_block_is_mapped_element_exactly():
    """D (32-token blocks) holds 96 tokens; P's 128-token block 0 holds tokens 0-127: only its last 32
    tokens are written, and K's dim-major packing is followed on both sides."""
    src = make_layout("k_transposed", layers=2, num_blocks=8, block_size=128, heads=2, head_dim=4)
    dst = make_layout("k_transposed", layers=2, num_blocks=16, block_size=32, heads=2, head_dim=4)
    s_blocks, d_blocks = [5, 2], [9, 1, 4, 0, 7, 3, 12]  # 200 tokens
    s_buf, d_buf = buffer_for(src), buffer_for(dst)
    fill(s_buf, src, s_blocks, 200)
    d_buf.view(np.int32)[:] = HELD
    seg = plan(src, [s_blocks], dst, [d_blocks[3:]], 200, first_token=96)
    apply(seg, s_buf, d_buf)
    got = gather(d_buf, dst, d_blocks, 200)
    np.testing.assert_array_equal(got[..., 96:, :], expected(src, 200)[..., 96:, :])
    assert (got[..., :96, :] == HELD).all()
    assert pushed_blocks(dst, 96, 200) == 4 and pushed_blocks(src, 96, 200) == 2


def test_token_runs_stay_inside_one_block_of_each_side():
    starts, lens = token_runs(96, 200, 128, 32)
    assert list(zip(starts.tolist(), lens.tolist(), strict=True)) == [
        (96, 32), (128, 32), (160, 32), (192, 8)
    ]  # fmt: skip
    starts, lens = token_runs(40, 50, 64, 16)
    assert list(zip(starts.tolist(), lens.tolist(), strict=True)) == [(40, 8), (48, 2)]


def test_block_tables_skip_the_held_blocks_on_each_side():
    p = make_layout("head_major", layers=1, num_blocks=16, block_size=8, heads=1, head_dim=2)
    d = make_layout("head_major", layers=1, num_blocks=16, block_size=4, heads=1, head_dim=2)
    # P lists the prompt from token 0; tokens [12, 30) start in its block 1
    assert block_table(p, [[9, 8, 7, 6]], 30, "producer", first_token=12).tolist() == [[8, 7, 6]]
    # D lists from token 12 (its block 3): blocks 3..7
    assert block_table(d, [[1, 2, 3, 4, 5]], 30, "consumer", first_token=12, listed_from=12).tolist() == [
        [1, 2, 3, 4, 5]
    ]


@pytest.mark.parametrize(
    ("first", "message"),
    [
        (6, "consumer block list starts at token 6, not on a 4-token block boundary"),
        (30, r"token range \[30, 30\) .* is empty"),
        (-4, r"token range \[-4, 30\)"),
    ],
)
def test_a_first_token_that_cannot_be_proven_is_refused(first, message):
    """Never a partial write: a first token off D's block boundary, or an empty range, raises."""
    p = make_layout("head_major", layers=1, num_blocks=16, block_size=8, heads=1, head_dim=2)
    d = make_layout("head_major", layers=1, num_blocks=16, block_size=4, heads=1, head_dim=2)
    with pytest.raises(LayoutError, match=message):
        plan(p, [[0, 1, 2, 3]], d, [[0, 1, 2, 3, 4, 5, 6, 7]], 30, first_token=first)


def test_too_few_lacking_blocks_are_named():
    p = make_layout("head_major", layers=1, num_blocks=16, block_size=8, heads=1, head_dim=2)
    d = make_layout("head_major", layers=1, num_blocks=16, block_size=4, heads=1, head_dim=2)
    with pytest.raises(LayoutError, match=r"consumer group 0 has 3 blocks, tokens \[12, 30\) need 5"):
        plan(p, [[0, 1, 2, 3]], d, [[0, 1, 2]], 30, first_token=12)
