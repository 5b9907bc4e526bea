"""GPU check step: the KV pages vLLM allocates for its CUDA backends, built with torch alone.

vLLM (`kv_cache_interface.create_kv_cache_views`) views one int8 buffer as a 5D byte tensor
[L, B, H, N, C] (layers, blocks, KV heads, tokens, C = 2 * head_dim elements: K then V) whose
strides follow the `KVCacheLayout`'s physical order, and gives each layer its 4D [B, H, N, C] view
in the KV dtype. Layer-outermost orders put each layer's pages in one region; block-outermost
orders pack every layer's page of a block together (the KVCacheTensor's layer and block strides).
FLASH_ATTN's and FLASHINFER's `do_kv_cache_update` both split a page as
`kv_cache.transpose(1, 2).split(head_dim, -1)` and end in `reshape_and_cache_flash`, whose
semantics for plain caches is `cache[slot // bs, slot % bs] = x`. tests/unit/gpucheck pins these
views and writes to vLLM's own code byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# vLLM's KVCacheLayout: the physical order of the logical axes [L, B, H, N, C] (vllm/v1/kv_cache_layout.py).
STRIDE_ORDER: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
}
ORDERS = tuple(STRIDE_ORDER)
BACKENDS = ("FLASH_ATTN", "FLASHINFER")
DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
Write = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], None]


def page_bytes(heads: int, block_size: int, head_dim: int, elem_bytes: int) -> int:
    """FullAttentionSpec.page_size_bytes: one layer's block, K and V."""
    return 2 * heads * block_size * head_dim * elem_bytes


def buffer_strides(order: str, *, layers: int, num_blocks: int, page: int) -> tuple[int, int]:
    """(layer_stride, block_stride) in bytes of the one backing buffer, as vLLM places a
    KVCacheTensor shared by all layers: contiguous layer regions, or every layer's page per block."""
    if STRIDE_ORDER[order][0] == 0:
        return page * num_blocks, page
    return page, page * layers


def kv_views(
    raw: torch.Tensor,
    order: str,
    *,
    layers: int,
    num_blocks: int,
    heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One [B, H, N, 2 * head_dim] view per layer of `raw` (int8, `layers` pages per block), with the
    strides `create_kv_cache_views` gives them for `order`."""
    import torch

    if order not in STRIDE_ORDER:
        raise ValueError(f"unknown KV cache layout {order!r}; one of {', '.join(ORDERS)}")
    elem = torch.empty((), dtype=dtype).element_size()
    page = page_bytes(heads, block_size, head_dim, elem)
    if raw.dtype != torch.int8 or raw.numel() < page * num_blocks * layers:
        raise ValueError(f"raw buffer must be int8 of at least {page * num_blocks * layers} bytes")
    shape = (layers, num_blocks, heads, block_size, 2 * head_dim * elem)
    fixed = (*buffer_strides(order, layers=layers, num_blocks=num_blocks, page=page), None, None, None)
    strides = [0] * 5
    current = 1
    for dim in reversed(STRIDE_ORDER[order]):  # compute_layout_strides: innermost physical axis first
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    view = torch.as_strided(raw, shape, strides, raw.storage_offset())
    assert prod(shape) == page * num_blocks * layers
    return [view[i].view(dtype) for i in range(layers)]


def scatter(head_dim: int) -> Write:
    """The backend's KV write (`do_kv_cache_update`): split the page into K and V views, then store
    token i at [slot // bs, slot % bs]. Bytes are stored through integer views so every KV dtype
    (fp8 included) takes the same indexed copy on every device."""
    from kvferry.connector.kvcache import int_of_size

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)  # (B, N, H, D) each
        n = slots.shape[0]
        bs = key_cache.shape[1]
        blk, off = slots // bs, slots % bs
        bits = int_of_size(cache.element_size())
        for src, dst in ((key, key_cache), (value, value_cache)):
            dst.view(bits)[blk, off] = src[:n].to(dst.dtype).view(bits)

    return write
