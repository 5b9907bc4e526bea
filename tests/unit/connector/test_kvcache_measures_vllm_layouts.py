"""kvcache: the layout is measured through vLLM's own KV write, and what cannot be measured or fitted
is refused with a reason (never guessed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvferry.connector.kvcache import UnsupportedCacheError, check_spec, probe_offsets, spec_window
from kvferry.tools.hostkv import CacheShape
from kvferry.tools.vllmkv import VllmKV
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

SHAPE = dict(layers=1, heads=2, head_dim=32, num_blocks=4)


def test_vllm_cpu_vec_kernel_stores_k_dim_major_and_v_token_major():
    """The fact behind issue 13: vLLM-CPU's vec ISA transposes K inside a block."""
    kv = VllmKV(CacheShape(**SHAPE, block_size=32, order="cpu/vec", dtype="float32"), 0)
    k, v = kv.layout.planes
    assert k.token_offsets[:3] == (0, 4, 8) and k.dim_offsets[:3] == (0, 128, 256)  # K[d * 32 + t]
    assert v.token_offsets[:3] == (0, 128, 256) and v.dim_offsets[:3] == (0, 4, 8)  # V[t * 32 + d]
    assert kv.layout.kind == "CPU_ATTN/vec" and kv.layout.dtype == "float32"


def test_amx_packing_is_measured_not_assumed():
    kv = VllmKV(CacheShape(**SHAPE, block_size=32, order="cpu/amx", dtype="bfloat16"), 0)
    k = kv.layout.planes[0]
    # bf16 AMX: K in (dim pair, token, 2) tiles, so dims 0 and 1 are adjacent and tokens 2 elements apart
    assert k.dim_offsets[:2] == (0, 2) and k.token_offsets[:2] == (0, 4)
    assert "[tiled]" in kv.layout.describe()


@pytest.mark.parametrize("order", ["cuda/FLASH_ATTN/LBNHC", "cuda/FLASH_ATTN/LBHNC", "cuda/FLASH_ATTN/BLNHC"])
def test_cuda_page_views_hold_k_then_v_per_token(order):
    kv = VllmKV(
        CacheShape(
            layers=2, heads=2, head_dim=32, num_blocks=4, block_size=16, order=order, dtype="bfloat16"
        ),
        0,
    )
    k, v = kv.layout.planes
    assert v.offset - k.offset == 32 * 2  # the page's content cell is K then V (flash_attn split)
    assert k.dim_offsets[:2] == (0, 2)
    head_major = order.endswith("HNC")
    assert (kv.layout.head_stride > k.token_offsets[1]) == head_major
    if order.startswith("cuda/FLASH_ATTN/BL"):  # block-outermost: both layers' pages in one block
        assert kv.layout.block_stride == 2 * kv.layout.page_bytes
        assert len(kv.layout.spans()) == 1


def test_a_write_that_drops_or_duplicates_elements_is_refused():
    like = torch.zeros(2, 1, 4, 4, dtype=torch.float32)  # [blocks, heads, tokens, 2 * dim]

    def drops_v(key, value, cache, slots):
        cache[0, :, slots, :2] = key.transpose(0, 1)

    def duplicates(key, value, cache, slots):
        cache[0, :, slots, :2] = key.transpose(0, 1)
        cache[0, :, slots, 2:] = key.transpose(0, 1)

    for write in (drops_v, duplicates):
        with pytest.raises(UnsupportedCacheError, match="stored"):
            probe_offsets(write, like, num_heads=1, head_dim=2, src_dtype=torch.float32)


def test_probe_is_exact_for_a_plain_write():
    like = torch.zeros(2, 1, 4, 4, dtype=torch.float32)

    def plain(key, value, cache, slots):
        cache[0, :, slots, :2] = key.transpose(0, 1)
        cache[0, :, slots, 2:] = value.transpose(0, 1)

    off = probe_offsets(plain, like, num_heads=1, head_dim=2, src_dtype=torch.float32)
    assert off.shape == (2, 1, 4, 2)
    assert off[0, 0, :, 0].tolist() == [0, 16, 32, 48] and off[1, 0, 0].tolist() == [8, 12]
    assert np.unique(off).size == off.size


def test_specs_that_are_not_plain_attention_kv_are_refused_by_name():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedCacheError, match="layer L0: MLA"):
        check_spec("L0", mla)
    mamba = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,))
    with pytest.raises(UnsupportedCacheError, match="MambaSpec is not attention"):
        check_spec("L1", mamba)
    odd = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, head_size_v=32, dtype=torch.float16)
    with pytest.raises(UnsupportedCacheError, match="head_size_v"):
        check_spec("L2", odd)
    check_spec("L3", FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16))


def test_groups_whose_kept_blocks_are_not_proven_are_refused_by_name():
    """Only full attention and plain sliding windows move: vLLM frees other groups' blocks by rules
    kvferry does not derive (chunks, sinks, speculative tails), so they are refused at start-up."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SinkFullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=64, **common)
    with pytest.raises(UnsupportedCacheError, match="layer C: KV cache spec ChunkedLocalAttentionSpec"):
        check_spec("C", chunked)
    with pytest.raises(UnsupportedCacheError, match="SinkFullAttentionSpec"):
        check_spec("S", SinkFullAttentionSpec(sink_len=4, **common))
    with pytest.raises(UnsupportedCacheError, match="extra_retained_tokens=3"):
        check_spec("W", SlidingWindowSpec(sliding_window=64, extra_retained_tokens=3, **common))
    check_spec("W", SlidingWindowSpec(sliding_window=64, **common))
    assert spec_window(SlidingWindowSpec(sliding_window=64, **common)) == 64
    # a windowed layer vLLM manages as full (hybrid allocator off) keeps every block
    assert spec_window(FullAttentionSpec(sliding_window=64, **common)) == 0


def test_a_layout_refused_at_start_reaches_the_pod_status_as_preflight_failed(tmp_path):
    """Only the running engine can tell (backend, KV groups, TP against the KV heads): the refusal is
    the termination message the operator turns into PreflightFailed, not a bare crash loop."""
    from kvferry.connector.worker import refuse_at_start
    from kvferry.operator.status import podchecks
    from kvferry.operator.status.conditions import Reason

    log = tmp_path / "termination-log"
    refuse_at_start("kv_layout: 8 KV heads cannot be split over tp_size=16", tmp_path / "absent")
    assert not (tmp_path / "absent").exists()  # outside a container nothing is created
    log.touch()
    refuse_at_start("kv_layout: 8 KV heads cannot be split over tp_size=16", log)
    message = log.read_text()
    pod = {
        "metadata": {"name": "x-decode-0", "labels": {"kvferry.io/role": "decode"}},
        "status": {"containerStatuses": [{"lastState": {"terminated": {"exitCode": 1, "message": message}}}]},
    }
    found = podchecks.start_failure([pod])
    assert found is not None and found[0] == Reason.PREFLIGHT_FAILED and "tp_size=16" in found[1]
