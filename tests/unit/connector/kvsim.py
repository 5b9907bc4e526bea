"""Test helper: a KV cache in a numpy byte buffer, filled and read through a `KVLayout`.

Addresses are offsets into one buffer, so a plan can be applied with plain slicing: the same
arithmetic NIXL would do, without NIXL.
"""

from __future__ import annotations

import numpy as np
from kvferry.connector.layout import KVLayout, Segments

ORIGIN = 4096  # region bases are offsets from here; 0 is not a valid address


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
    """A layout whose regions are laid out back to back from ORIGIN."""
    factory = KVLayout.head_major if kind == "head_major" else KVLayout.token_major
    probe = factory(
        bases=[ORIGIN],
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_dim=head_dim,
        elem_bytes=4,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    bases = [ORIGIN + i * probe.region_bytes for i in range(layers)]
    return factory(
        bases=bases,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_dim=head_dim,
        elem_bytes=4,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def buffer_for(layout: KVLayout) -> np.ndarray:
    return np.zeros(ORIGIN + len(layout.regions) * layout.region_bytes, dtype=np.uint8)


def token_value(layer: int, plane: int, head: int, token: int, dim: int) -> np.ndarray:
    """A float32 vector unique to (layer, plane, head, token)."""
    base = ((layer * 2 + plane) * 64 + head) * 100000 + token
    return (np.arange(dim, dtype=np.float32) + base * 1000.0).astype(np.float32)


def _addr(layout: KVLayout, layer: int, plane: int, head: int, token: int, blocks: list[int]) -> int:
    r = layout.regions[layer]
    block = blocks[token // layout.block_size]
    return (
        r.base
        + block * layout.block_stride
        + plane * layout.plane_stride
        + (head - layout.head_offset) * layout.head_stride
        + (token % layout.block_size) * layout.token_stride
    )


def fill(buf: np.ndarray, layout: KVLayout, blocks: list[int], num_tokens: int) -> None:
    dim = layout.seg_bytes // 4
    for layer in range(len(layout.regions)):
        for plane in range(layout.num_planes):
            for head in layout.heads():
                for t in range(num_tokens):
                    a = _addr(layout, layer, plane, head, t, blocks)
                    buf[a : a + layout.seg_bytes] = token_value(layer, plane, head, t, dim).view(np.uint8)


def read(
    buf: np.ndarray, layout: KVLayout, blocks: list[int], layer: int, plane: int, head: int, token: int
) -> np.ndarray:
    a = _addr(layout, layer, plane, head, token, blocks)
    return buf[a : a + layout.seg_bytes].view(np.float32)


def apply(seg: Segments, src: np.ndarray, dst: np.ndarray) -> None:
    for s, d, n in zip(seg.src_addr.tolist(), seg.dst_addr.tolist(), seg.length.tolist(), strict=True):
        dst[d : d + n] = src[s : s + n]
