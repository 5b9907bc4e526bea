"""mapping.plan + coalesce: the consumer, read through its own layout, holds the producer's KV,
element by element, whatever each side's block size, TP split and in-block packing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.connector.layout import KVLayout, LayoutError, check_compatible, overlapping_ranks, split_heads
from kvferry.connector.mapping import block_aligned, coalesce, element_addresses, plan
from kvferry.tools.hostkv import synthetic_layout
from kvsim import KINDS, apply, buffer_for, expected, fill, gather, make_layout

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
    common = dict(
        layers=draw(st.integers(1, 2)), num_blocks=40, heads=heads, head_dim=draw(st.sampled_from([1, 2, 4]))
    )
    src = make_layout(
        draw(st.sampled_from(KINDS)), block_size=draw(BLOCK_SIZES), tp_rank=p_rank, tp_size=p_tp, **common
    )
    dst = make_layout(
        draw(st.sampled_from(KINDS)), block_size=draw(BLOCK_SIZES), tp_rank=d_rank, tp_size=d_tp, **common
    )

    def blocks(layout):
        need = -(-num_tokens // layout.block_size)
        return draw(st.permutations(range(40)))[:need] if draw(st.booleans()) else list(range(3, 3 + need))

    return src, blocks(src), dst, blocks(dst), num_tokens


def shared(src: KVLayout, dst: KVLayout) -> tuple[slice, slice]:
    lo, hi = max(src.head_offset, dst.head_offset), min(src.heads().stop, dst.heads().stop)
    return slice(lo - src.head_offset, hi - src.head_offset), slice(
        lo - dst.head_offset, hi - dst.head_offset
    )


@settings(max_examples=80, deadline=None)
@given(transfer_case(), st.booleans(), st.booleans())
def test_consumer_reads_producer_values_for_every_element(case, merge_patterns, merge_all):
    src, s_blocks, dst, d_blocks, n = case
    s_buf, d_buf = buffer_for(src), buffer_for(dst)
    fill(s_buf, src, s_blocks, n)
    seg = plan(src, [s_blocks], dst, [d_blocks], n, merge=merge_patterns)
    apply(coalesce(seg) if merge_all else seg, s_buf, d_buf)
    s_heads, d_heads = shared(src, dst)
    got = gather(d_buf, dst, d_blocks, n)[:, :, d_heads]
    np.testing.assert_array_equal(got, expected(src, n)[:, :, s_heads])
    # nothing but the shared heads' elements was written on the consumer
    addr = element_addresses(dst, [d_blocks], n)[:, :, d_heads].ravel()
    written = np.zeros(d_buf.size, dtype=bool)
    written[(addr[:, None] + np.arange(4)).ravel()] = True
    assert not d_buf[~written].any()


@settings(max_examples=60, deadline=None)
@given(transfer_case())
def test_coalescing_keeps_bytes_and_never_adds_descriptors(case):
    src, s_blocks, dst, d_blocks, n = case
    seg = plan(src, [s_blocks], dst, [d_blocks], n, merge=False)
    merged = coalesce(seg)
    assert merged.total_bytes == seg.total_bytes
    s_heads, _ = shared(src, dst)
    assert seg.total_bytes == expected(src, n)[:, :, s_heads].size * 4  # every shared element, once
    assert len(merged) <= len(seg)
    order = np.argsort(merged.dst_addr)
    ends = merged.dst_addr[order] + merged.length[order]
    assert (ends[:-1] <= merged.dst_addr[order][1:]).all()  # no consumer byte written twice


def test_k_transposed_blocks_of_different_sizes_are_not_copied_token_major():
    """The root cause of silent corruption on vLLM-CPU (vec ISA: K stored dim-major in a block):
    a token-major copy between 32- and 128-token blocks scrambles K. The mapping must follow K's
    real packing: read back, every element equals what was sent."""
    src = make_layout("k_transposed", layers=2, num_blocks=8, block_size=32, heads=2, head_dim=4)
    dst = make_layout("k_transposed", layers=2, num_blocks=4, block_size=128, heads=2, head_dim=4)
    s_buf, d_buf = buffer_for(src), buffer_for(dst)
    fill(s_buf, src, [3, 1, 0, 2, 5], 150)
    apply(coalesce(plan(src, [[3, 1, 0, 2, 5]], dst, [[2, 0]], 150)), s_buf, d_buf)
    np.testing.assert_array_equal(gather(d_buf, dst, [2, 0], 150), expected(src, 150))
    # and a token-major description of the same bytes would have put K elsewhere
    wrong = make_layout("head_major", layers=2, num_blocks=4, block_size=128, heads=2, head_dim=4)
    assert not np.array_equal(gather(d_buf, wrong, [2, 0], 150), expected(src, 150))


def test_same_layout_contiguous_blocks_coalesce_to_one_descriptor_per_layer():
    layout = make_layout("head_major", layers=3, num_blocks=64, block_size=16, heads=4, head_dim=8)
    seg = plan(layout, [list(range(10, 20))], layout, [list(range(30, 40))], 160)
    assert len(coalesce(seg)) == 3
    assert block_aligned(layout, layout)


def test_whole_block_copy_only_between_identical_dense_layouts():
    a = make_layout("k_transposed", layers=1, num_blocks=8, block_size=16, heads=2, head_dim=4)
    b = make_layout("head_major", layers=1, num_blocks=8, block_size=16, heads=2, head_dim=4)
    c = make_layout("k_transposed", layers=1, num_blocks=8, block_size=32, heads=2, head_dim=4)
    assert block_aligned(a, a) and not block_aligned(a, b) and not block_aligned(a, c)


def test_block_id_out_of_range_is_named():
    layout = make_layout("head_major", layers=1, num_blocks=8, block_size=4, heads=1, head_dim=2)
    with pytest.raises(LayoutError, match="block id 8 out of range"):
        plan(layout, [[0, 1]], layout, [[7, 8]], 8)


def test_too_few_blocks_is_named():
    layout = make_layout("head_major", layers=1, num_blocks=8, block_size=4, heads=1, head_dim=2)
    with pytest.raises(LayoutError, match="consumer group 0 has 1 blocks"):
        plan(layout, [[0, 1]], layout, [[7]], 8)


def test_unmappable_layouts_are_refused_naming_the_difference_and_both_layouts():
    a = make_layout("head_major", layers=2, num_blocks=8, block_size=4, heads=2, head_dim=2)
    b = make_layout("head_major", layers=2, num_blocks=8, block_size=4, heads=2, head_dim=4)
    c = make_layout("head_major", layers=3, num_blocks=8, block_size=4, heads=2, head_dim=2)
    with pytest.raises(
        LayoutError, match=r"head_dim: producer 2, consumer 4; producer: synthetic/head_major"
    ):
        plan(a, [[0]], b, [[0]], 4)
    with pytest.raises(LayoutError, match="layer count"):
        check_compatible(a, c)
    bf16 = synthetic_layout(
        "head_major",
        bases=[4096],
        num_blocks=8,
        block_size=4,
        num_heads=2,
        head_dim=4,
        elem_bytes=2,
        dtype="bfloat16",
    )
    fp16 = synthetic_layout(
        "head_major",
        bases=[4096],
        num_blocks=8,
        block_size=4,
        num_heads=2,
        head_dim=4,
        elem_bytes=2,
        dtype="float16",
    )
    with pytest.raises(LayoutError, match="dtype: producer bfloat16, consumer float16"):
        check_compatible(bf16, fp16)


def _fit(offsets, like):
    return KVLayout.from_offsets(
        offsets, block_stride=like.block_stride, bases=[4096], num_blocks=4, kind="x", dtype="float32",
        head_offset=0, total_heads=2, elem_bytes=4,
    )  # fmt: skip


def test_offsets_that_are_not_separable_are_refused():
    good = make_layout("k_transposed", layers=1, num_blocks=4, block_size=4, heads=2, head_dim=2)
    off = good.block_offsets().copy()
    assert _fit(off, good).signature()["planes"] == good.signature()["planes"]
    off[1, 0, 2, 1], off[1, 0, 3, 1] = off[1, 0, 3, 1], off[1, 0, 2, 1]  # two V elements swapped
    with pytest.raises(LayoutError, match="cannot describe this packing"):
        _fit(off, good)


def test_overlapping_elements_are_refused():
    layout = make_layout("head_major", layers=1, num_blocks=4, block_size=4, heads=2, head_dim=2)
    with pytest.raises(LayoutError, match="two elements of a block overlap"):
        dataclasses.replace(layout, head_stride=4)


def test_heads_that_cannot_be_split_are_rejected():
    with pytest.raises(LayoutError, match="cannot be split"):
        split_heads(2, 0, 4)


def test_overlapping_ranks_split_and_merge():
    assert overlapping_ranks(8, 0, 1, 4) == [0, 1, 2, 3]
    assert overlapping_ranks(8, 3, 4, 2) == [1]
    assert overlapping_ranks(8, 1, 2, 2) == [1]
