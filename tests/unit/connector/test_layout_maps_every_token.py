"""layout.plan + coalesce: the consumer, read through its own layout, holds the producer's KV."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.connector.layout import LayoutError, coalesce, overlapping_ranks, plan, split_heads
from kvsim import apply, buffer_for, fill, make_layout, read, token_value

BLOCK_SIZES = st.sampled_from([2, 4, 8, 16, 32])


@st.composite
def transfer_case(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    p_tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0]))
    d_tp = draw(st.sampled_from([t for t in (1, 2, 4) if heads % t == 0]))
    p_rank, d_rank = draw(st.integers(0, p_tp - 1)), draw(st.integers(0, d_tp - 1))
    if d_rank not in overlapping_ranks(heads, p_rank, p_tp, d_tp):
        d_rank = overlapping_ranks(heads, p_rank, p_tp, d_tp)[0]
    num_tokens = draw(st.integers(1, 70))
    common = dict(layers=draw(st.integers(1, 2)), num_blocks=40, heads=heads, head_dim=2)
    src = make_layout(
        draw(st.sampled_from(["head_major", "token_major"])),
        block_size=draw(BLOCK_SIZES),
        tp_rank=p_rank,
        tp_size=p_tp,
        **common,
    )
    dst = make_layout(
        draw(st.sampled_from(["head_major", "token_major"])),
        block_size=draw(BLOCK_SIZES),
        tp_rank=d_rank,
        tp_size=d_tp,
        **common,
    )

    def blocks(layout):
        need = -(-num_tokens // layout.block_size)
        return draw(st.permutations(range(40)))[:need] if draw(st.booleans()) else list(range(3, 3 + need))

    return src, blocks(src), dst, blocks(dst), num_tokens


@settings(max_examples=60, deadline=None)
@given(transfer_case(), st.booleans())
def test_consumer_reads_producer_values_for_every_token_layer_head(case, merge):
    src, s_blocks, dst, d_blocks, n = case
    s_buf, d_buf = buffer_for(src), buffer_for(dst)
    fill(s_buf, src, s_blocks, n)
    seg = plan(src, [s_blocks], dst, [d_blocks], n)
    apply(coalesce(seg) if merge else seg, s_buf, d_buf)
    shared = range(max(src.head_offset, dst.head_offset), min(src.heads().stop, dst.heads().stop))
    for layer in range(len(dst.regions)):
        for plane in range(2):
            for head in shared:
                for t in range(n):
                    got = read(d_buf, dst, d_blocks, layer, plane, head, t)
                    np.testing.assert_array_equal(got, token_value(layer, plane, head, t, 2))


@settings(max_examples=60, deadline=None)
@given(transfer_case())
def test_coalescing_keeps_bytes_and_never_adds_descriptors(case):
    src, s_blocks, dst, d_blocks, n = case
    seg = plan(src, [s_blocks], dst, [d_blocks], n)
    merged = coalesce(seg)
    assert merged.total_bytes == seg.total_bytes
    assert len(merged) <= len(seg)
    # no two merged descriptors overlap on the consumer side
    order = np.argsort(merged.dst_addr)
    ends = merged.dst_addr[order] + merged.length[order]
    assert (ends[:-1] <= merged.dst_addr[order][1:]).all()


def test_same_layout_contiguous_blocks_coalesce_to_one_descriptor_per_layer():
    layout = make_layout("head_major", layers=3, num_blocks=64, block_size=16, heads=4, head_dim=8)
    seg = plan(layout, [list(range(10, 20))], layout, [list(range(30, 40))], 160)
    assert len(seg) == 3 * 2 * 10 * 4
    assert len(coalesce(seg)) == 3


def test_block_id_out_of_range_is_named():
    layout = make_layout("head_major", layers=1, num_blocks=8, block_size=4, heads=1, head_dim=2)
    with pytest.raises(LayoutError, match="block id 8 out of range"):
        plan(layout, [[0, 1]], layout, [[7, 8]], 8)


def test_too_few_blocks_is_named():
    layout = make_layout("head_major", layers=1, num_blocks=8, block_size=4, heads=1, head_dim=2)
    with pytest.raises(LayoutError, match="consumer group 0 has 1 blocks"):
        plan(layout, [[0, 1]], layout, [[7]], 8)


def test_unmappable_layouts_name_the_difference():
    a = make_layout("head_major", layers=2, num_blocks=8, block_size=4, heads=2, head_dim=2)
    b = make_layout("head_major", layers=2, num_blocks=8, block_size=4, heads=2, head_dim=4)
    c = make_layout("head_major", layers=3, num_blocks=8, block_size=4, heads=2, head_dim=2)
    with pytest.raises(LayoutError, match="seg_bytes"):
        plan(a, [[0]], b, [[0]], 4)
    with pytest.raises(LayoutError, match="layer count"):
        plan(a, [[0]], c, [[0]], 4)


def test_heads_that_cannot_be_split_are_rejected():
    with pytest.raises(LayoutError, match="cannot be split"):
        split_heads(2, 0, 4)


def test_overlapping_ranks_split_and_merge():
    assert overlapping_ranks(8, 0, 1, 4) == [0, 1, 2, 3]
    assert overlapping_ranks(8, 3, 4, 2) == [1]
    assert overlapping_ranks(8, 1, 2, 2) == [1]
