"""KV caches built and written by vLLM's own code move between processes over real NIXL and land
exactly: vLLM-CPU's ISA packings and the pages vLLM allocates for its CUDA backends (FLASH_ATTN
views in every layer/block order; FLASHINFER shares that split), bf16/fp16/fp8/fp32, different
block sizes and TP on each side, GPU-layout producer to CPU-layout consumer and back.

Each consumer compares what arrived value by value through its own measured layout, and its whole
pages byte by byte with what its own vLLM write of the same KV stores (tools/vllmkv.py).
"""

from __future__ import annotations

import pytest
from kvferry.tools.hostkv import CacheShape

from tests.nixl.helpers import expect_args

pytestmark = pytest.mark.nixl
MODEL = dict(layers=2, heads=4, head_dim=64)


def shape(order: str, block_size: int, dtype: str = "bfloat16", tp: int = 1, blocks: int = 24) -> CacheShape:
    return CacheShape(**MODEL, num_blocks=blocks, block_size=block_size, order=order, tp_size=tp, dtype=dtype)


FA = "cuda/FLASH_ATTN/"
CASES = {
    # the silent-corruption root cause: vLLM-CPU vec keeps K dim-major in a block
    "cpu-vec-bs32-to-cpu-vec-bs128-fp32": (
        shape("cpu/vec", 32, "float32"),
        shape("cpu/vec", 128, "float32"),
        300,
    ),
    "cpu-vec-bs128-to-cpu-vec-bs32-fp32": (
        shape("cpu/vec", 128, "float32"),
        shape("cpu/vec", 32, "float32"),
        300,
    ),
    "cpu-amx-bs32-to-cpu-vec-bs64-bf16": (shape("cpu/amx", 32), shape("cpu/vec", 64), 150),
    "gpu-LBNHC-bs16-to-cpu-vec-bs32-bf16": (shape(FA + "LBNHC", 16), shape("cpu/vec", 32), 70),
    "cpu-vec-bs32-to-gpu-LBHNC-bs16-tp2-bf16": (shape("cpu/vec", 32), shape(FA + "LBHNC", 16, tp=2), 70),
    "gpu-LBNHC-tp2-bs16-to-gpu-LBHNC-bs32-fp16": (
        shape(FA + "LBNHC", 16, "float16", tp=2),
        shape(FA + "LBHNC", 32, "float16"),
        200,
    ),
    "gpu-BLNHC-bs16-to-gpu-LBNHC-bs16-bf16": (shape(FA + "BLNHC", 16), shape(FA + "LBNHC", 16), 200),
    "gpu-LBHNC-bs16-same-layout-fp8": (
        shape(FA + "LBHNC", 16, "float8_e4m3fn"),
        shape(FA + "LBHNC", 16, "float8_e4m3fn"),
        200,
    ),
    "gpu-BLHNC-bs32-to-gpu-LBHNC-bs16-tp2-fp8": (
        shape(FA + "BLHNC", 32, "float8_e4m3fn"),
        shape(FA + "LBHNC", 16, "float8_e4m3fn", tp=2),
        200,
    ),
}


def blocks_for(tokens: int, block_size: int, first: int, reverse: bool = False) -> list[int]:
    ids = list(range(first, first + -(-tokens // block_size)))
    return ids[::-1] if reverse else ids


@pytest.mark.parametrize(("p_shape", "d_shape", "tokens"), CASES.values(), ids=CASES.keys())
def test_vllm_written_kv_lands_exactly_through_each_sides_own_layout(pooled, p_shape, d_shape, tokens):
    prods = pooled.start("producer", "prefill-0", p_shape, ranks=p_shape.tp_size)
    cons = pooled.start("consumer", "decode-0", d_shape, ranks=d_shape.tp_size)
    p_blocks = blocks_for(tokens, p_shape.block_size, 2, reverse=True)
    d_blocks = blocks_for(tokens, d_shape.block_size, 1)
    for c in cons:
        c.call("expect", "req-1", 0, expect_args(prods[0], d_blocks, tokens, tp=p_shape.tp_size))
    for p in prods:
        p.call("finish", "req-1", 0, p_blocks, tokens, "decode-0")
    for c in cons:
        assert c.call("results", 60.0, 1)["received"] == [("req-1", 0)]
        assert c.call("mismatches", d_blocks, tokens, timeout_s=120.0) == 0
    for p in prods:
        assert p.call("results", 10.0, 1)["sent"] == [("req-1", 0)]
    same = (p_shape.order, p_shape.block_size, p_shape.tp_size) == (d_shape.order, d_shape.block_size, 1)
    mode = "prepped" if same else "coalesced"
    assert f'kvferry_descriptors_per_transfer_count{{mode="{mode}"}}' in prods[0].call("metrics")
