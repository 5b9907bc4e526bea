"""Demo step: a KV cache in host memory with known contents, read back through its own layout.

Used by `kvferry transfer-demo`, the NIXL process tests and the benchmark: the producer fills its
blocks with values that depend only on (layer, plane, global head, token, dim); the consumer gathers
its blocks through its own layout and compares with the same formula. `order` picks the cache: a
synthetic layout (pure numpy: `head_major`, `token_major`, `k_transposed`), or one built and
written by vLLM's own code (`cpu/<isa>`, `cuda/FLASH_ATTN/<KVCacheLayout>`: vllmkv.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from kvferry.connector.layout import KVLayout, LayoutError, PlaneMap, regions_at, split_heads
from kvferry.connector.mapping import element_addresses

ALIGN = 4096
SYNTHETIC = ("head_major", "token_major", "k_transposed")


@dataclass(frozen=True)
class CacheShape:
    """A side's KV cache: same model on both sides (layers, heads, head_dim, dtype); its own block
    size, TP size and in-block order."""

    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    num_blocks: int = 64
    block_size: int = 16
    order: str = "head_major"  # a SYNTHETIC name, or vllmkv.VLLM_ORDERS
    tp_size: int = 1
    dtype: str = "float32"  # vLLM-built caches only; synthetic ones hold int32 words


def synthetic_layout(
    order: str,
    *,
    bases: Sequence[int],
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    elem_bytes: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    groups: Sequence[int] | None = None,
    dtype: str = "",
) -> KVLayout:
    """Test and demo layouts (pure numpy caches): `head_major` ([blocks, heads, 2 * bs, dim], each
    token's dims contiguous), `token_major` (NHD pages: [blocks, 2, bs, heads, dim]) and
    `k_transposed` (vLLM-CPU `vec` packing: per head K dim-major, V token-major)."""
    local = split_heads(num_heads, tp_rank, tp_size)
    e, bs, hd, h = elem_bytes, block_size, head_dim, len(local)
    tok, dim = [t * hd * e for t in range(bs)], [d * e for d in range(hd)]
    if order == "head_major":
        planes = (PlaneMap(0, tuple(tok), tuple(dim)), PlaneMap(bs * hd * e, tuple(tok), tuple(dim)))
        head_stride, block_stride = 2 * bs * hd * e, h * 2 * bs * hd * e
    elif order == "k_transposed":
        k = PlaneMap(0, tuple(t * e for t in range(bs)), tuple(d * bs * e for d in range(hd)))
        planes = (k, PlaneMap(bs * hd * e, tuple(tok), tuple(dim)))
        head_stride, block_stride = 2 * bs * hd * e, h * 2 * bs * hd * e
    elif order == "token_major":
        tok = [t * h * hd * e for t in range(bs)]
        planes = (PlaneMap(0, tuple(tok), tuple(dim)), PlaneMap(bs * h * hd * e, tuple(tok), tuple(dim)))
        head_stride, block_stride = hd * e, 2 * bs * h * hd * e
    else:
        raise LayoutError(f"unknown synthetic order {order!r}")
    return KVLayout(
        kind=f"synthetic/{order}",
        dtype=dtype or f"{8 * e}-bit",
        block_size=bs,
        num_heads=h,
        head_offset=local.start,
        total_heads=num_heads,
        head_dim=hd,
        elem_bytes=e,
        head_stride=head_stride,
        block_stride=block_stride,
        planes=planes,
        regions=regions_at(bases, num_blocks, groups),
    )


def host_kv(shape: CacheShape, tp_rank: int) -> Any:
    """The cache for `shape` (HostKV or vllmkv.VllmKV: same fill / mismatches / layout surface)."""
    if shape.order in SYNTHETIC:
        return HostKV(shape, tp_rank)
    from kvferry.tools.vllmkv import VllmKV

    return VllmKV(shape, tp_rank)


class HostKV:
    """One TP rank's synthetic cache: a page-aligned int32 buffer holding every layer, and its KVLayout."""

    def __init__(self, shape: CacheShape, tp_rank: int) -> None:
        factory = partial(synthetic_layout, shape.order)
        kw = dict(
            num_blocks=shape.num_blocks,
            block_size=shape.block_size,
            num_heads=shape.heads,
            head_dim=shape.head_dim,
            elem_bytes=4,
            tp_rank=tp_rank,
            tp_size=shape.tp_size,
            dtype="int32",
        )
        region = factory(bases=[ALIGN], **kw).region_bytes
        self._raw = np.zeros(shape.layers * region + 2 * ALIGN, dtype=np.uint8)
        start = -self._raw.ctypes.data % ALIGN
        self.base = self._raw.ctypes.data + start
        self.buf = self._raw[start : start + shape.layers * region]
        self.layout = factory(bases=[self.base + i * region for i in range(shape.layers)], **kw)
        self.words = self.buf.view(np.int32)

    def _word_index(self, blocks: list[int], num_tokens: int) -> np.ndarray:
        """int32 index of every (layer, plane, local head, token, dim)."""
        return (element_addresses(self.layout, [blocks], num_tokens) - self.base) // 4

    def expected(self, num_tokens: int) -> np.ndarray:
        """The values every side agrees on, for this rank's heads."""
        lay = self.layout
        layer, plane, head, tok, dim = np.ogrid[
            : len(lay.regions),
            : lay.num_planes,
            lay.head_offset : lay.head_offset + lay.num_heads,
            :num_tokens,
            : lay.head_dim,
        ]
        v = layer * 1_000_003 + plane * 7_919 + head * 104_729 + tok * 613 + dim * 1_299_709 + 1
        return (v % (2**31 - 1)).astype(np.int32)

    def fill(self, blocks: list[int], num_tokens: int) -> None:
        self.words[self._word_index(blocks, num_tokens)] = self.expected(num_tokens)

    def clear(self, blocks: list[int], num_tokens: int) -> None:
        """Zero the blocks: what a consumer's reused blocks look like before anything writes them."""
        self.words[self._word_index(blocks, num_tokens)] = 0

    def gather(self, blocks: list[int], num_tokens: int) -> np.ndarray:
        return self.words[self._word_index(blocks, num_tokens)]

    def mismatches(self, blocks: list[int], num_tokens: int) -> int:
        """Values that differ from the producer's, read through this rank's own layout."""
        return int((self.gather(blocks, num_tokens) != self.expected(num_tokens)).sum())
