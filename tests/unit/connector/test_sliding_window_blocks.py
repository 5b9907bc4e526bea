"""Sliding windows: what vLLM's own KV manager keeps, and the mapping moving only that.

The root cause of decode's wrong first tokens under concurrency (sliding-window models): vLLM's
sliding-window manager retires the blocks before a window counting from the tokens it is told are
computed, and lists its shared null block there. A decode told the whole prompt (N tokens) arrived
then recomputes token N - 1, whose window reaches token N - W: for N = W + k * block - 1 that token
sits in a block vLLM already nulled, so decode read whatever the null block held (another request's
KV, written there by the push). These tests run vLLM's real KVCacheManager: with the connector's
count (N - 1: decode computes the last prompt token itself), every block the first computed token
attends to is a real block; the old count (N) is shown to fail for exactly those lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.connector.config import KvferryConfig
from kvferry.connector.layout import KVLayout, LayoutError, regions_at
from kvferry.connector.mapping import HOLE, block_pairs, element_addresses, missing_block, plan
from kvferry.connector.scheduler import NULL_BLOCK_ID, KvferryScheduler, with_holes
from kvferry.tools.hostkv import synthetic_layout

torch = pytest.importorskip("torch")
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402


def _manager(window: int, block: int) -> KVCacheManager:
    sw = SlidingWindowSpec(
        block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=window
    )
    full = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["swa"], sw)]
    cfg = KVCacheConfig(num_blocks=400, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        cfg, max_model_len=8192, scheduler_block_size=block, hash_block_size=block, enable_caching=False
    )


def _request(n: int, rid: str = "r") -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=4), None)


def _loaded(manager: KVCacheManager, n: int, count: int) -> list[list[int]]:
    """Decode: the blocks vLLM allocates for `count` prompt tokens arriving from outside."""
    req = _request(n)
    manager.allocate_slots(req, 0, 0, None, num_external_computed_tokens=count, delay_cache_blocks=True)
    ids = [list(g) for g in manager.get_blocks(req.request_id).get_block_ids()]
    manager.free(req)
    return ids


def _window_blocks_real(ids: list[int], first_computed: int, window: int, block: int) -> bool:
    """Every block holding a token of the window of token `first_computed` is a real block."""
    lo = max(0, first_computed - window + 1)
    return all(ids[b] != NULL_BLOCK_ID for b in range(lo // block, first_computed // block))


def test_vllm_null_block_is_block_zero():
    manager = _manager(64, 16)
    assert manager.block_pool.null_block.block_id == NULL_BLOCK_ID
    assert with_holes([[0, 5, 0], [7]]) == [[HOLE, 5, HOLE], [7]]


@pytest.mark.parametrize(("window", "block"), [(64, 64), (64, 32), (64, 128), (48, 16), (64, 16)])
def test_decode_keeps_every_block_its_first_computed_token_reads(window, block):
    manager = _manager(window, block)
    sched = KvferryScheduler(KvferryConfig(), is_producer=False, windows=(0, window))
    failed_before = []
    for n in range(2, 4 * window + 3 * block):
        req = _request(n)
        req.kv_transfer_params = {"do_remote_prefill": True}
        count = n - sched.tail  # get_num_new_matched_tokens' count with no local hit
        ids = _loaded(manager, n, count)
        # vLLM recomputes the last prompt token when told the whole prompt arrived
        first = count if count < n else n - 1
        assert _window_blocks_real(ids[1], first, window, block), (n, ids[1])
        assert all(b != NULL_BLOCK_ID for b in ids[0])  # full attention keeps everything
        if not _window_blocks_real(_loaded(manager, n, n)[1], n - 1, window, block):
            failed_before.append(n)
    # the old count (the whole prompt) reads a nulled block exactly at n = window + k * block - 1
    assert failed_before and all((n - window + 1) % block == 0 for n in failed_before), failed_before


def test_prefill_keeps_the_window_decode_needs_even_when_chunked():
    """P computes L = N - 1 tokens (maybe in chunks) and vLLM retires blocks again at finish: what it
    still holds covers the tokens decode needs (KVLayout.kept_from)."""
    window, block = 64, 16
    for n in (127, 191, 300, 1000):
        for chunk in (n, 100, 37):
            manager = _manager(window, block)
            req = _request(n - 1, f"p{n}-{chunk}")
            done = 0
            while done < n - 1:
                step = min(chunk, n - 1 - done)
                assert manager.allocate_slots(req, step) is not None
                req.num_computed_tokens = done = done + step
            manager.remove_skipped_blocks(req.request_id, done)  # as _connector_finished does
            ids = manager.get_blocks(req.request_id).get_block_ids()[1]
            keep = (n - 1) - window + 1
            assert all(ids[b] != NULL_BLOCK_ID for b in range(keep // block, -(-(n - 1) // block))), (
                n,
                chunk,
            )


def _layout(block: int, windows: tuple[int, ...], num_blocks: int = 160) -> KVLayout:
    """Two layers: layer 0 in group 0 (windowed when windows[0]), layer 1 in group 1 (full)."""
    kw = dict(num_blocks=num_blocks, block_size=block, num_heads=2, head_dim=4, elem_bytes=4, dtype="float32")
    one = synthetic_layout("head_major", bases=[4096], **kw)
    bases = [4096, 4096 + one.region_bytes]
    return dataclasses.replace(one, regions=regions_at(bases, num_blocks, [0, 1]), windows=windows)


def _blocks(layout: KVLayout, num_tokens: int, computed: int, offset: int) -> list[list[int]]:
    """vLLM's lists: the windowed group nulls the blocks before the window of `computed` tokens."""
    need = -(-num_tokens // layout.block_size)
    out = []
    for g in (0, 1):
        w = layout.window(g)
        gone = max(0, computed - w + 1) // layout.block_size if w else 0
        out.append([HOLE if j < gone else offset + g * need + j for j in range(need)])
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([4, 8, 16]),
    st.sampled_from([4, 8, 16]),
    st.integers(3, 20),
    st.integers(2, 90),
)
def test_plan_moves_only_kept_tokens_and_never_touches_a_hole(p_block, d_block, window, n):
    src, dst = _layout(p_block, (window, 0)), _layout(d_block, (window, 0))
    s_ids, d_ids = _blocks(src, n, n, 0), _blocks(dst, n, n, 20)
    seg = plan(src, s_ids, dst, d_ids, n)
    s_addr, d_addr = element_addresses(src, s_ids, n), element_addresses(dst, d_ids, n)
    kept = n - window + 1
    # every consumer element of a kept token is written, from the producer's same element
    written = {}
    for d, s, ln in zip(seg.dst_addr.tolist(), seg.src_addr.tolist(), seg.length.tolist(), strict=True):
        for k in range(0, ln, 4):
            assert d + k not in written  # no consumer byte written twice
            written[d + k] = s + k
    want = {int(d): int(s) for d, s in zip(d_addr.ravel(), s_addr.ravel(), strict=True) if d != HOLE}
    assert written == want
    # the windowed layer's older tokens are not moved at all; the full layer's are
    assert (d_addr[0, :, :, :kept] == HOLE).all() if kept > 0 else True
    assert (d_addr[1] != HOLE).all()


def test_a_needed_token_in_a_hole_is_refused_on_either_side():
    src, dst = _layout(16, (64, 0)), _layout(16, (64, 0))
    n = 200
    s_ids, d_ids = _blocks(src, n, n, 0), _blocks(dst, n, n, 30)
    plan(src, s_ids, dst, d_ids, n)  # as vLLM keeps them: fine
    kept_block = (n - 64 + 1) // 16
    for side in ("producer", "consumer"):
        bad = [list(g) for g in (s_ids if side == "producer" else d_ids)]
        bad[0][kept_block] = HOLE
        args = (bad, d_ids) if side == "producer" else (s_ids, bad)
        with pytest.raises(LayoutError, match=f"{side} holds no block for token"):
            plan(src, args[0], dst, args[1], n)
        with pytest.raises(LayoutError, match=f"{side} holds no block"):
            block_pairs(src, args[0], dst, args[1], n)
    assert missing_block(dst, d_ids, n) == ""
    d_bad = [list(g) for g in d_ids]
    d_bad[0][kept_block] = HOLE
    assert "null block for tokens" in missing_block(dst, d_bad, n)
    d_bad = [list(g) for g in d_ids]
    d_bad[1][0] = HOLE  # a hole in a full-attention group is never fine
    assert "KV group 1" in missing_block(dst, d_bad, n)


def test_whole_block_copies_skip_the_window_s_retired_blocks():
    layout = _layout(16, (64, 0))
    n = 200
    s_ids, d_ids = _blocks(layout, n, n, 0), _blocks(layout, n, n, 30)
    s_out, d_out = block_pairs(layout, s_ids, layout, d_ids, n)
    first = (n - 64 + 1) // 16
    assert s_out[0].tolist() == s_ids[0][first:] and d_out[0].tolist() == d_ids[0][first:]
    assert s_out[1].tolist() == s_ids[1] and d_out[1].tolist() == d_ids[1]
    assert HOLE not in s_out[0].tolist() + d_out[0].tolist()


def test_layouts_with_different_windows_are_refused():
    a, b = _layout(16, (64, 0)), _layout(16, (32, 0))
    with pytest.raises(LayoutError, match="window"):
        plan(a, _blocks(a, 100, 100, 0), b, _blocks(b, 100, 100, 20), 100)
    assert a.fingerprint != _layout(16, (0, 0)).fingerprint


def test_producer_shortens_only_windowed_models_prompts():
    def request(n: int) -> Request:
        r = _request(n)
        r.kv_transfer_params = {
            "do_remote_decode": True,
            "kvferry": {"v": 1, "role": "producer", "request_id": "x", "attempt": 0,
                        "consumer_engine": "d", "deadline_s": 10.0},
        }  # fmt: skip
        return r

    windowed = KvferryScheduler(KvferryConfig(), is_producer=True, windows=(64,))
    full = KvferryScheduler(KvferryConfig(), is_producer=True, windows=(0,))
    r = request(100)
    windowed.on_new_request(r)
    assert r.num_prompt_tokens == 99 and len(r.prompt_token_ids) == 99 and r.max_tokens == 1
    assert len(r.all_token_ids) == 99
    r = request(100)
    full.on_new_request(r)
    assert r.num_prompt_tokens == 100
    one = request(1)
    windowed.on_new_request(one)  # nothing left to prefill: untouched
    assert one.num_prompt_tokens == 1
    assert np.array_equal(np.array(r.prompt_token_ids), np.arange(10, 110))
