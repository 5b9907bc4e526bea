"""The GPU check's page layouts and scatter are vLLM's: for every CUDA page order and KV dtype, the
per-layer views equal what vLLM's `create_kv_cache_views` builds, the bytes our scatter stores equal
what vLLM's FLASH_ATTN `do_kv_cache_update` (and FLASHINFER's, run from vLLM's own source) store,
and the layout the connector measures through our write equals the one measured through vLLM's."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import textwrap
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvferry.tools.gpucheck.devkv import DeviceKV, Side  # noqa: E402
from kvferry.tools.gpucheck.pages import BACKENDS, DTYPES, ORDERS, kv_views, scatter  # noqa: E402
from kvferry.tools.hostkv import CacheShape  # noqa: E402
from kvferry.tools.vllmkv import VllmKV, reference_reshape_and_cache_flash  # noqa: E402

LAYERS, BLOCKS, HEADS, BS, DIM = 3, 5, 2, 16, 32
CASES = [(o, d) for o in ORDERS for d in DTYPES]


def vllm_views(order: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[order]
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)
    page = spec.page_size_bytes
    size = page * BLOCKS * LAYERS
    strides = (page * BLOCKS, page) if layout.is_layer_compact else (page, page * LAYERS)
    raw = torch.zeros(size, dtype=torch.int8)
    names = [f"layers.{i}.attn" for i in range(LAYERS)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
    return raw, create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)


def ours(dtype: torch.dtype, order: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    raw = torch.zeros(LAYERS * BLOCKS * 2 * HEADS * BS * DIM * dtype.itemsize, dtype=torch.int8)
    views = kv_views(
        raw, order, layers=LAYERS, num_blocks=BLOCKS, heads=HEADS, block_size=BS, head_dim=DIM, dtype=dtype
    )
    return raw, views


def kv_and_slots(n: int = 37) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    key = torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16)
    value = torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16)
    slots = torch.randperm(BLOCKS * BS, generator=g)[:n]
    return key, value, slots


def flash_attn_write(dtype: torch.dtype):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends import flash_attn

    cfg = VllmConfig()
    object.__setattr__(cfg, "model_config", types.SimpleNamespace(dtype=torch.bfloat16))
    with set_current_vllm_config(cfg):
        impl = flash_attn.FlashAttentionImpl(
            num_heads=HEADS, head_size=DIM, scale=1.0, num_kv_heads=HEADS,
            alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
        )  # fmt: skip
    layer = types.SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))

    def write(k, v, cache, slots):
        flash_attn.reshape_and_cache_flash = reference_reshape_and_cache_flash
        try:
            impl.do_kv_cache_update(layer, k, v, cache, slots)
        finally:
            del flash_attn.reshape_and_cache_flash

    return write


def flashinfer_write():
    """FlashInferImpl.do_kv_cache_update compiled from vLLM's own source (the module imports the
    flashinfer package, absent on CPU), its CUDA op bound to the reference scatter."""
    path = Path(importlib.util.find_spec("vllm").origin).parent / "v1/attention/backends/flashinfer.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FlashInferImpl")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "do_kv_cache_update")
    src = textwrap.dedent(ast.get_source_segment(path.read_text(), fn))
    ops = types.SimpleNamespace(
        _C_cache_ops=types.SimpleNamespace(reshape_and_cache_flash=reference_reshape_and_cache_flash)
    )
    ns: dict = {"torch": types.SimpleNamespace(Tensor=torch.Tensor, nn=torch.nn, ops=ops)}
    exec(compile(src, str(path), "exec"), ns)  # noqa: S102 - vLLM's own code, read from the installed file
    impl = types.SimpleNamespace(
        kv_sharing_target_layer_name=None, nvfp4_fa2=False, is_kvcache_nvfp4=False,
        head_size=DIM, num_kv_heads=HEADS, cache_dtype="auto",
    )  # fmt: skip
    layer = types.SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))
    return lambda k, v, cache, slots: ns["do_kv_cache_update"](impl, layer, k, v, cache, slots)


@pytest.mark.parametrize(("order", "dtype"), CASES)
def test_views_are_vllms(order, dtype):
    dt = getattr(torch, dtype)
    _, want = vllm_views(order, dt)
    _, got = ours(dt, order)
    for w, g in zip(want, got, strict=True):
        assert (g.shape, g.stride(), g.storage_offset(), g.dtype) == (
            w.shape, w.stride(), w.storage_offset(), w.dtype
        )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("order", "dtype"), CASES)
def test_scatter_stores_the_bytes_vllms_write_stores(backend, order, dtype):
    dt = getattr(torch, dtype)
    theirs = flash_attn_write(dt) if backend == "FLASH_ATTN" else flashinfer_write()
    want_raw, want = vllm_views(order, dt)
    got_raw, got = ours(dt, order)
    key, value, slots = kv_and_slots()
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        theirs(key + i, value - i, w, slots)
        scatter(DIM)(key + i, value - i, g, slots)
    assert want_raw.count_nonzero() > 0
    assert torch.equal(want_raw, got_raw)


@pytest.mark.parametrize(("order", "dtype"), CASES)
def test_measured_layout_is_the_one_measured_through_vllm(order, dtype):
    shape = CacheShape(layers=2, heads=4, head_dim=DIM, num_blocks=BLOCKS, block_size=BS,
                       order=f"cuda/FLASH_ATTN/{order}", tp_size=2, dtype=dtype)  # fmt: skip
    side = Side(
        "FLASH_ATTN", order, BS, 2, dtype, layers=2, heads=4, head_dim=DIM, num_blocks=BLOCKS, device="cpu"
    )
    theirs, mine = VllmKV(shape, 1).layout, DeviceKV(side, 1).layout
    skip = {"regions", "kind"}
    fields = [f.name for f in dataclasses.fields(mine) if f.init and f.name not in skip]
    assert {f: getattr(mine, f) for f in fields} == {f: getattr(theirs, f) for f in fields}


def test_a_changed_byte_is_counted():
    side = Side("FLASH_ATTN", "BLHNC", BS, 1, "float8_e4m3fn", layers=2, heads=2, head_dim=DIM,
                num_blocks=BLOCKS, device="cpu")  # fmt: skip
    kv = DeviceKV(side, 0)
    kv.fill([3, 1], 20)
    assert kv.mismatches([3, 1], 20) == 0
    kv.tensors[1].view(torch.uint8)[1, 0, 3, DIM + 5] ^= 1  # layer 1, token 19 (block 1, slot 3): V dim 5
    assert kv.mismatches([3, 1], 20) == 2  # read through the layout, and in the page bytes
