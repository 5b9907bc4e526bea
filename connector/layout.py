"""Layout step: block ids -> byte ranges on each side, producer-to-consumer mapping, coalescing.

Pure arithmetic (numpy only, no NIXL, vLLM or torch). Each side describes its own KV cache as a
`KVLayout`; the producer maps its blocks onto the consumer's blocks token by token and head by head,
so the two sides may use different block sizes (16 vs 32, 128 vs 64 tokens), different TP sizes (heads
split or merged) and different in-block orders (head-major or token-major).

Address of one token of one head in one plane (K or V) of one layer:

    region.base + block_id * block_stride + plane * plane_stride + head * head_stride + slot * token_stride

with `seg_bytes` contiguous bytes there (head_dim * element size). vLLM's CPU cache
([blocks, heads, 2 * block_size, head_dim], K slots then V slots per head) is `KVLayout.head_major`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class LayoutError(ValueError):
    """A layout or block list that cannot be mapped; the message names what is wrong."""


@dataclass(frozen=True)
class Region:
    """One layer's KV memory on one rank."""

    base: int
    num_blocks: int
    group: int = 0  # KV cache group (HMA): which list of block ids addresses this region


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV cache, described as strides so each side maps to its own physical layout."""

    block_size: int  # tokens per block
    num_heads: int  # KV heads held by this rank
    head_offset: int  # global index of the first held head (TP rank * heads per rank)
    total_heads: int  # KV heads of the model
    num_planes: int  # 2 (K, V); 1 for a latent cache
    seg_bytes: int  # bytes of one token of one head in one plane
    token_stride: int
    head_stride: int
    plane_stride: int
    block_stride: int
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        for name in ("block_size", "num_heads", "total_heads", "num_planes", "seg_bytes"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"layout.{name} must be positive, got {getattr(self, name)}")
        for name in ("token_stride", "head_stride", "plane_stride", "block_stride"):
            if getattr(self, name) < self.seg_bytes:
                raise LayoutError(f"layout.{name}={getattr(self, name)} is smaller than seg_bytes")
        if not self.head_offset >= 0 or self.head_offset + self.num_heads > self.total_heads:
            raise LayoutError(
                f"layout heads [{self.head_offset}, {self.head_offset + self.num_heads}) "
                f"outside the model's {self.total_heads} KV heads"
            )
        if not self.regions:
            raise LayoutError("layout.regions is empty")
        for i, r in enumerate(self.regions):
            if r.num_blocks <= 0 or r.base <= 0 or r.group < 0:
                raise LayoutError(f"layout.regions[{i}] is invalid: {r}")

    @classmethod
    def head_major(
        cls,
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
    ) -> KVLayout:
        """vLLM CPU layout: per block, per head, K tokens then V tokens ([blocks, heads, 2*bs, dim])."""
        local = split_heads(num_heads, tp_rank, tp_size)
        seg = head_dim * elem_bytes
        return cls(
            block_size=block_size,
            num_heads=len(local),
            head_offset=local.start,
            total_heads=num_heads,
            num_planes=2,
            seg_bytes=seg,
            token_stride=seg,
            plane_stride=block_size * seg,
            head_stride=2 * block_size * seg,
            block_stride=len(local) * 2 * block_size * seg,
            regions=_regions(bases, num_blocks, groups),
        )

    @classmethod
    def token_major(
        cls,
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
    ) -> KVLayout:
        """Token-major (NHD) blocks: [blocks, 2, block_size, heads, dim]."""
        local = split_heads(num_heads, tp_rank, tp_size)
        seg = head_dim * elem_bytes
        return cls(
            block_size=block_size,
            num_heads=len(local),
            head_offset=local.start,
            total_heads=num_heads,
            num_planes=2,
            seg_bytes=seg,
            head_stride=seg,
            token_stride=len(local) * seg,
            plane_stride=block_size * len(local) * seg,
            block_stride=2 * block_size * len(local) * seg,
            regions=_regions(bases, num_blocks, groups),
        )

    @property
    def region_bytes(self) -> int:
        """Bytes one region spans (what to register with NIXL)."""
        return self.regions[0].num_blocks * self.block_stride

    def heads(self) -> range:
        return range(self.head_offset, self.head_offset + self.num_heads)


def _regions(bases: Sequence[int], num_blocks: int, groups: Sequence[int] | None) -> tuple[Region, ...]:
    groups = list(groups) if groups is not None else [0] * len(bases)
    if len(groups) != len(bases):
        raise LayoutError(f"{len(groups)} groups given for {len(bases)} regions")
    return tuple(Region(int(b), num_blocks, g) for b, g in zip(bases, groups, strict=True))


def split_heads(total_heads: int, tp_rank: int, tp_size: int) -> range:
    """Heads a TP rank holds. Replicated heads (tp_size > heads) are not supported: say so."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
    if total_heads % tp_size:
        raise LayoutError(f"{total_heads} KV heads cannot be split over tp_size={tp_size}")
    per = total_heads // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


def overlapping_ranks(total_heads: int, my_rank: int, my_tp: int, peer_tp: int) -> list[int]:
    """Peer TP ranks whose heads overlap mine: who a rank writes to, or expects writes from."""
    mine = split_heads(total_heads, my_rank, my_tp)
    return [
        r
        for r in range(peer_tp)
        if (h := split_heads(total_heads, r, peer_tp)).start < mine.stop and mine.start < h.stop
    ]


@dataclass(frozen=True)
class Segments:
    """Byte ranges to write: src_addr[i] .. +length[i] -> dst_addr[i] (numpy uint64/int64 arrays)."""

    src_addr: np.ndarray
    dst_addr: np.ndarray
    length: np.ndarray
    src_region: np.ndarray
    dst_region: np.ndarray

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise LayoutError naming the first property that makes two layouts unmappable."""
    for name in ("total_heads", "num_planes", "seg_bytes"):
        if getattr(src, name) != getattr(dst, name):
            raise LayoutError(
                f"layouts differ in {name}: producer {getattr(src, name)}, consumer {getattr(dst, name)}"
            )
    if len(src.regions) != len(dst.regions):
        raise LayoutError(
            f"layouts differ in layer count: producer {len(src.regions)}, consumer {len(dst.regions)}"
        )
    for i, (a, b) in enumerate(zip(src.regions, dst.regions, strict=True)):
        if a.group != b.group:
            raise LayoutError(
                f"layer {i} is in KV group {a.group} on the producer, {b.group} on the consumer"
            )


def block_table(
    layout: KVLayout, block_ids: Sequence[Sequence[int]], num_tokens: int, side: str
) -> np.ndarray:
    """Per group, the first ceil(num_tokens / block_size) block ids, range-checked (shape groups x n)."""
    need = -(-num_tokens // layout.block_size)
    groups = {r.group for r in layout.regions}
    if max(groups) >= len(block_ids):
        raise LayoutError(f"{side} sent {len(block_ids)} block-id groups, layout uses group {max(groups)}")
    table = np.zeros((len(block_ids), need), dtype=np.int64)
    limit = layout.regions[0].num_blocks
    for g in sorted(groups):
        ids = block_ids[g]
        if len(ids) < need:
            raise LayoutError(f"{side} group {g} has {len(ids)} blocks, {num_tokens} tokens need {need}")
        row = np.asarray(ids[:need], dtype=np.int64)
        bad = (row < 0) | (row >= limit)
        if bad.any():
            raise LayoutError(f"{side} block id {int(row[bad][0])} out of range [0, {limit}) in group {g}")
        table[g] = row
    return table


def plan(
    src: KVLayout,
    src_blocks: Sequence[Sequence[int]],
    dst: KVLayout,
    dst_blocks: Sequence[Sequence[int]],
    num_tokens: int,
) -> Segments:
    """Every (layer, plane, shared head, token run) the producer must write, uncoalesced.

    A token run never crosses a block boundary of either side, so each unit is contiguous on both
    sides when tokens are contiguous within a head; otherwise units are single tokens.
    """
    check_compatible(src, dst)
    if num_tokens <= 0:
        raise LayoutError(f"num_tokens must be positive, got {num_tokens}")
    s_tab = block_table(src, src_blocks, num_tokens, "producer")
    d_tab = block_table(dst, dst_blocks, num_tokens, "consumer")
    lo, hi = max(src.head_offset, dst.head_offset), min(src.heads().stop, dst.heads().stop)
    if lo >= hi:
        raise LayoutError(f"producer heads {src.heads()} and consumer heads {dst.heads()} do not overlap")
    starts, lens = _token_runs(src, dst, num_tokens)
    heads = np.arange(lo, hi, dtype=np.int64)
    planes = np.arange(src.num_planes, dtype=np.int64)
    n_units = len(src.regions) * planes.size * starts.size * heads.size
    out = {k: np.empty(n_units, dtype=np.int64) for k in ("src", "dst", "len", "sr", "dr")}
    per_region = planes.size * starts.size * heads.size
    for i, (rs, rd) in enumerate(zip(src.regions, dst.regions, strict=True)):
        sl = slice(i * per_region, (i + 1) * per_region)
        out["src"][sl] = _addresses(src, rs, s_tab[rs.group], starts, planes, heads - src.head_offset)
        out["dst"][sl] = _addresses(dst, rd, d_tab[rd.group], starts, planes, heads - dst.head_offset)
        shape = (planes.size, starts.size, heads.size)
        out["len"][sl] = np.broadcast_to(lens[None, :, None] * src.seg_bytes, shape).ravel()
        out["sr"][sl] = i
        out["dr"][sl] = i
    return Segments(out["src"], out["dst"], out["len"], out["sr"], out["dr"])


def _token_runs(src: KVLayout, dst: KVLayout, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Token runs that stay inside one block on both sides (single tokens if a side is token-major)."""
    if src.token_stride != src.seg_bytes or dst.token_stride != dst.seg_bytes:
        return np.arange(num_tokens, dtype=np.int64), np.ones(num_tokens, dtype=np.int64)
    step = math.gcd(src.block_size, dst.block_size)
    bounds = np.union1d(np.arange(0, num_tokens, step, dtype=np.int64), [num_tokens])
    return bounds[:-1], np.diff(bounds)


def _addresses(
    layout: KVLayout,
    region: Region,
    blocks: np.ndarray,
    starts: np.ndarray,
    planes: np.ndarray,
    heads: np.ndarray,
) -> np.ndarray:
    """Start address of each (plane, run, head) unit in one region, flattened in that order."""
    run_off = blocks[starts // layout.block_size] * layout.block_stride + (starts % layout.block_size) * (
        layout.token_stride
    )
    addr = (
        region.base
        + planes[:, None, None] * layout.plane_stride
        + run_off[None, :, None]
        + heads[None, None, :] * layout.head_stride
    )
    return addr.ravel()


def coalesce(seg: Segments) -> Segments:
    """Merge units contiguous on both sides (same regions) into as few descriptors as possible.

    Sorting by source address puts every mergeable pair next to each other, whatever the order
    the block lists came in; one linear pass then merges runs.
    """
    if len(seg) == 0:
        return seg
    order = np.argsort(seg.src_addr, kind="stable")
    src, dst, ln = seg.src_addr[order], seg.dst_addr[order], seg.length[order]
    sr, dr = seg.src_region[order], seg.dst_region[order]
    joins = (
        (src[:-1] + ln[:-1] == src[1:])
        & (dst[:-1] + ln[:-1] == dst[1:])
        & (sr[:-1] == sr[1:])
        & (dr[:-1] == dr[1:])
    )
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    return Segments(src[heads], dst[heads], np.add.reduceat(ln, heads), sr[heads], dr[heads])
