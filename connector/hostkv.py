"""Demo step: a KV cache in host memory with known contents, read back through its own layout.

Used by `kvferry transfer-demo`, the NIXL process tests and the benchmark: the producer fills its
blocks with values that depend only on (layer, plane, global head, token, dim); the consumer gathers
its blocks through its own layout and compares with the same formula.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from kvferry.connector.layout import KVLayout

ALIGN = 4096


@dataclass(frozen=True)
class CacheShape:
    """A side's KV cache: same model on both sides (layers, heads, head_dim); its own block size,
    TP size and in-block order."""

    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    num_blocks: int = 64
    block_size: int = 16
    order: str = "head_major"  # head_major (vLLM CPU) | token_major
    tp_size: int = 1


class HostKV:
    """One TP rank's cache: a page-aligned int32 buffer holding every layer, and its KVLayout."""

    def __init__(self, shape: CacheShape, tp_rank: int) -> None:
        factory = KVLayout.head_major if shape.order == "head_major" else KVLayout.token_major
        kw = dict(
            num_blocks=shape.num_blocks,
            block_size=shape.block_size,
            num_heads=shape.heads,
            head_dim=shape.head_dim,
            elem_bytes=4,
            tp_rank=tp_rank,
            tp_size=shape.tp_size,
        )
        region = factory(bases=[ALIGN], **kw).region_bytes
        self._raw = np.zeros(shape.layers * region + 2 * ALIGN, dtype=np.uint8)
        start = -self._raw.ctypes.data % ALIGN
        self.base = self._raw.ctypes.data + start
        self.buf = self._raw[start : start + shape.layers * region]
        self.layout = factory(bases=[self.base + i * region for i in range(shape.layers)], **kw)
        self.words = self.buf.view(np.int32)

    def _word_index(self, blocks: list[int], num_tokens: int) -> np.ndarray:
        """int32 index of every (layer, plane, local head, token, dim): shape L x P x H x T x D."""
        lay = self.layout
        tok = np.arange(num_tokens)
        blk = np.asarray(blocks, dtype=np.int64)[tok // lay.block_size]
        tok_off = blk * lay.block_stride + (tok % lay.block_size) * lay.token_stride
        layer_off = np.array([r.base - self.base for r in lay.regions])
        off = (
            layer_off[:, None, None, None]
            + np.arange(lay.num_planes)[None, :, None, None] * lay.plane_stride
            + np.arange(lay.num_heads)[None, None, :, None] * lay.head_stride
            + tok_off[None, None, None, :]
        )
        return off[..., None] // 4 + np.arange(lay.seg_bytes // 4)

    def expected(self, num_tokens: int) -> np.ndarray:
        """The values every side agrees on, for this rank's heads."""
        lay = self.layout
        layer, plane, head, tok, dim = np.ogrid[
            : len(lay.regions),
            : lay.num_planes,
            lay.head_offset : lay.head_offset + lay.num_heads,
            :num_tokens,
            : lay.seg_bytes // 4,
        ]
        v = layer * 1_000_003 + plane * 7_919 + head * 104_729 + tok * 613 + dim * 1_299_709 + 1
        return (v % (2**31 - 1)).astype(np.int32)

    def fill(self, blocks: list[int], num_tokens: int) -> None:
        self.words[self._word_index(blocks, num_tokens)] = self.expected(num_tokens)

    def gather(self, blocks: list[int], num_tokens: int) -> np.ndarray:
        return self.words[self._word_index(blocks, num_tokens)]

    def mismatches(self, blocks: list[int], num_tokens: int) -> int:
        """Values that differ from the producer's, read through this rank's own layout."""
        return int((self.gather(blocks, num_tokens) != self.expected(num_tokens)).sum())
