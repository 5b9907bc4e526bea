"""Test helper: a KV cache in a numpy byte buffer, filled and read back through a `KVLayout`.

Addresses are offsets into one buffer, so a plan can be applied with plain slicing: the same
arithmetic NIXL would do, without NIXL. Values are unique per (layer, plane, global head, token,
dim), so a read-back compares what arrived with what was sent, element by element.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from kvferry.connector.layout import KVLayout
from kvferry.connector.mapping import Segments, element_addresses
from kvferry.tools.hostkv import synthetic_layout

ORIGIN = 4096  # region bases are offsets from here; 0 is not a valid address
KINDS = ("head_major", "token_major", "k_transposed")


def make_layout(
    kind: str,
    *,
    layers: int,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> KVLayout:
    """A layout whose regions are laid out back to back from ORIGIN (4-byte elements)."""
    factory = partial(synthetic_layout, kind)
    kw = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_dim=head_dim,
        elem_bytes=4,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype="float32",
    )
    size = factory(bases=[ORIGIN], **kw).region_bytes
    return factory(bases=[ORIGIN + i * size for i in range(layers)], **kw)


def buffer_for(layout: KVLayout) -> np.ndarray:
    return np.zeros(ORIGIN + len(layout.regions) * layout.region_bytes, dtype=np.uint8)


def expected(layout: KVLayout, num_tokens: int) -> np.ndarray:
    """layers x planes x heads (this rank's) x tokens x dims, as int32."""
    layer, plane, head, tok, dim = np.ogrid[
        : len(layout.regions), : layout.num_planes, layout.heads(), :num_tokens, : layout.head_dim
    ]
    v = layer * 1_000_003 + plane * 7_919 + head * 104_729 + tok * 613 + dim * 1_299_709 + 1
    return (v % (2**31 - 1)).astype(np.int32)


def _words(buf: np.ndarray, layout: KVLayout, blocks: list[int], num_tokens: int) -> np.ndarray:
    addr = element_addresses(layout, [blocks], num_tokens)
    assert (addr % 4 == 0).all()
    return addr // 4


def fill(buf: np.ndarray, layout: KVLayout, blocks: list[int], num_tokens: int) -> None:
    buf.view(np.int32)[_words(buf, layout, blocks, num_tokens)] = expected(layout, num_tokens)


def gather(buf: np.ndarray, layout: KVLayout, blocks: list[int], num_tokens: int) -> np.ndarray:
    return buf.view(np.int32)[_words(buf, layout, blocks, num_tokens)]


def apply(seg: Segments, src: np.ndarray, dst: np.ndarray) -> None:
    for s, d, n in zip(seg.src_addr.tolist(), seg.dst_addr.tolist(), seg.length.tolist(), strict=True):
        dst[d : d + n] = src[s : s + n]
