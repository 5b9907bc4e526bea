"""Demo/test step: KV caches in host memory built and written by vLLM's own code, for the NIXL
process tests and the GPU-layout proofs without a GPU.

- `cpu/<isa>`: vLLM-CPU's layer cache ([blocks, heads, block_size, 2 * head_dim]) written by
  `CPUAttentionBackendImpl.do_kv_cache_update` with that ISA (`vec`, `vec16`, `amx`): the kernel the
  engine runs, packing K its way.
- `cuda/FLASH_ATTN/<KVCacheLayout>`: the tensors vLLM allocates for a CUDA backend: one backing
  buffer viewed per layer by vLLM's `create_kv_cache_views` with the layout's strides (layer- or
  block-outermost), written by `FlashAttentionImpl.do_kv_cache_update` (vLLM's split of the page
  into K and V views). Only the scatter kernel it ends in (`reshape_and_cache_flash`, a CUDA op) is
  replaced by its reference semantics, `cache[slot // bs, slot % bs] = x`, so the bytes land where
  the CUDA kernel puts them. FLASHINFER uses the same split and kernel (flashinfer.py
  `do_kv_cache_update`), so its pages are these.

The layout each side transfers by is measured from the writer (kvcache.probe_offsets), exactly as
the connector does inside vLLM; `reference()` writes the same values through a fresh cache, so a
receiver can compare whole pages with what its own vLLM code would have stored.
"""

from __future__ import annotations

import ctypes
import types
from collections.abc import Callable
from typing import Any

import numpy as np
from kvferry.connector.kvcache import int_of_size, layout_from_tensors, probe_offsets, read_elements
from kvferry.connector.layout import KVLayout, split_heads

VLLM_ORDERS = ("cpu/vec", "cpu/vec16", "cpu/amx") + tuple(
    f"cuda/FLASH_ATTN/{o}" for o in ("LBNHC", "LBHNC", "BLNHC", "BLHNC")
)


def _vllm_context(dtype: Any) -> Any:
    """vLLM's backends read the current config at construction; a minimal one is enough here."""
    from vllm.config import VllmConfig, set_current_vllm_config

    cfg = VllmConfig()
    object.__setattr__(cfg, "model_config", types.SimpleNamespace(dtype=dtype))
    return set_current_vllm_config(cfg)


class VllmKV:
    """One TP rank's KV cache built by vLLM code, with its measured KVLayout."""

    def __init__(self, shape: Any, tp_rank: int) -> None:
        import torch

        self.shape = shape
        self.dtype = getattr(torch, shape.dtype)
        self.heads = split_heads(shape.heads, tp_rank, shape.tp_size)
        self.tensors, self._write, kind = self._build(len(self.heads))
        offsets = probe_offsets(
            self._write,
            self.tensors[0],
            num_heads=len(self.heads),
            head_dim=shape.head_dim,
            src_dtype=self.dtype,
        )
        self.layout: KVLayout = layout_from_tensors(
            self.tensors,
            offsets,
            kind=kind,
            total_heads=shape.heads,
            tp_rank=tp_rank,
            tp_size=shape.tp_size,
            groups=[0] * len(self.tensors),
        )
        self.tp_rank = tp_rank

    def _build(self, heads: int) -> tuple[list[Any], Callable, str]:
        import torch

        s = self.shape
        if s.order.startswith("cpu/"):
            isa = s.order.split("/", 1)[1]
            with _vllm_context(self.dtype):
                from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

                impl = CPUAttentionBackendImpl(
                    num_heads=heads, head_size=s.head_dim, scale=1.0, num_kv_heads=heads,
                    alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
                )  # fmt: skip
            layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
            tensors = [
                torch.zeros(s.num_blocks, heads, s.block_size, 2 * s.head_dim, dtype=self.dtype)
                for _ in range(s.layers)
            ]
            return (
                tensors,
                lambda k, v, c, slots: impl.do_kv_cache_update(layer, k, v, c, slots),
                f"CPU_ATTN/{isa}",
            )
        _, backend, order = s.order.split("/")
        if backend != "FLASH_ATTN":
            raise ValueError(f"unknown CUDA backend stand-in {backend!r}")
        return (*self._cuda_views(heads, order), f"FLASH_ATTN {order}")

    def _cuda_views(self, heads: int, order: str) -> tuple[list[Any], Callable]:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        s = self.shape
        layout = KVCacheLayout[order]
        spec = FullAttentionSpec(
            block_size=s.block_size, num_kv_heads=heads, head_size=s.head_dim, dtype=self.dtype
        )
        page = spec.page_size_bytes
        size = page * s.num_blocks * s.layers
        # vLLM's placement (KVCacheTensor docs): layer-outermost -> contiguous layer regions;
        # block-outermost -> each block packs every layer's page.
        strides = (page * s.num_blocks, page) if layout.is_layer_compact else (page, page * s.layers)
        names = [f"layers.{i}.attn" for i in range(s.layers)]
        self._raw = torch.zeros(size, dtype=torch.int8)
        tensor = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
        views = create_kv_cache_views(self._raw, spec, s.num_blocks, layout, tensor)
        with _vllm_context(self.dtype):
            from vllm.v1.attention.backends import flash_attn

            impl = flash_attn.FlashAttentionImpl(
                num_heads=heads, head_size=s.head_dim, scale=1.0, num_kv_heads=heads,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
            )  # fmt: skip
        layer = types.SimpleNamespace(_k_scale=torch.ones(()), _v_scale=torch.ones(()))

        def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
            # the CUDA op is imported into flash_attn only on CUDA builds: put the reference there
            original = getattr(flash_attn, "reshape_and_cache_flash", None)
            flash_attn.reshape_and_cache_flash = reference_reshape_and_cache_flash
            try:
                impl.do_kv_cache_update(layer, key, value, cache, slots)
            finally:
                if original is None:
                    del flash_attn.reshape_and_cache_flash
                else:
                    flash_attn.reshape_and_cache_flash = original

        return views, write

    # ---- contents ----
    def values(self, num_tokens: int) -> Any:
        """layers x planes x heads (this rank's) x tokens x dims, in the cache dtype."""
        import torch

        layer, plane, head, tok, dim = np.ogrid[
            : self.shape.layers, :2, self.heads.start : self.heads.stop, :num_tokens, : self.shape.head_dim
        ]
        v = (layer * 1_000_003 + plane * 7_919 + head * 104_729 + tok * 613 + dim * 1_299_709) % 251
        return torch.from_numpy(((v - 125) / 8.0).astype(np.float32)).to(self.dtype)

    def fill(self, blocks: list[int], num_tokens: int) -> None:
        """Write every layer's K and V for `num_tokens` tokens through vLLM's own write path."""
        import torch

        vals = self.values(num_tokens)
        tok = torch.arange(num_tokens)
        slots = torch.tensor(blocks, dtype=torch.int64)[tok // self.shape.block_size] * self.shape.block_size
        slots += tok % self.shape.block_size
        for i, t in enumerate(self.tensors):
            key = vals[i, 0].transpose(0, 1).contiguous()
            value = vals[i, 1].transpose(0, 1).contiguous()
            self._write(key, value, t, slots)

    def gather(self, blocks: list[int], num_tokens: int) -> np.ndarray:
        """Elements read through this rank's measured layout, as raw element bytes."""
        return read_elements(self.layout, [blocks], num_tokens)

    def pages(self, blocks: list[int]) -> np.ndarray:
        """The raw bytes of whole blocks (every layer), for a layout-free comparison."""
        out = []
        for r in self.layout.regions:
            for b in blocks:
                start = r.base + b * self.layout.block_stride
                out.append(
                    np.frombuffer((ctypes.c_uint8 * self.layout.page_bytes).from_address(start), np.uint8)
                )
        return np.concatenate(out).copy()

    def mismatches(self, blocks: list[int], num_tokens: int) -> int:
        """Elements that differ from what the producer wrote, read through this rank's layout, plus
        page bytes that differ from what this rank's own vLLM write of the same KV stores."""
        want = self.values(num_tokens).contiguous().view(int_of_size(self.layout.elem_bytes)).numpy()
        got = self.gather(blocks, num_tokens).view(want.dtype).reshape(want.shape)
        ref = VllmKV(self.shape, self.tp_rank)
        ref.fill(blocks, num_tokens)
        return int((got != want).sum()) + int((self.pages(blocks) != ref.pages(blocks)).sum())


def reference_reshape_and_cache_flash(
    key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any, *_: Any
) -> None:
    """What vLLM's CUDA `reshape_and_cache_flash` does for unquantized caches: token i of `key`
    goes to key_cache[slot // block_size, slot % block_size] (key_cache is [blocks, tokens, heads,
    dim], a strided view into the page)."""
    n = slot_mapping.shape[0]
    bs = key_cache.shape[1]
    blk, off = slot_mapping // bs, slot_mapping % bs
    key_cache[blk, off] = key[:n].to(key_cache.dtype)
    value_cache[blk, off] = value[:n].to(value_cache.dtype)
