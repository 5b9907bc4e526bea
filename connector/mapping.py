"""Mapping step: which producer bytes go to which consumer bytes for one request, coalesced (pure).

Given both sides' `KVLayout` (layout.py) and the blocks each lists for the request, `plan` maps every
element of tokens [first_token, num_tokens) of the producer onto the consumer, element by element,
and `coalesce` merges byte ranges that are contiguous on both sides into as few NIXL descriptors as
the two layouts allow. `element_addresses` is the same arithmetic for one side alone: what the
read-back checks compare. numpy only.

Sliding-window groups: vLLM keeps only a window's tail of a request's blocks and lists the shared
null block where the window has passed (the worker turns it into `HOLE`). A windowed group moves only
the tokens the consumer still attends to (`KVLayout.kept_from`); a needed token in a hole on either
side is refused, never read from or written into a block the request does not own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from kvferry.connector.layout import KVLayout, LayoutError, Pieces, check_compatible

HOLE = -1  # a block list entry that holds none of the request's KV (vLLM's null block)


@dataclass(frozen=True)
class Segments:
    """Byte ranges to write: src_addr[i] .. +length[i] -> dst_addr[i] (numpy int64 arrays)."""

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


def block_aligned(a: KVLayout, b: KVLayout) -> bool:
    """Block i of one side is byte for byte block j of the other: whole pages can be copied.
    (The declaring kind may differ: vLLM-CPU's vec and vec16 ISAs pack a block the same way.)"""
    sa, sb = a.signature(), b.signature()
    sa.pop("kind"), sb.pop("kind")
    return sa == sb and a.dense_page


def block_table(
    layout: KVLayout,
    block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    side: str,
    *,
    first_token: int = 0,
    listed_from: int = 0,
) -> np.ndarray:
    """Per group, the ids of the blocks holding tokens [first_token, num_tokens), range-checked (shape
    groups x n; column j is the block holding token first_token - first_token % block_size + j *
    block_size). `block_ids[g][0]` holds token `listed_from`, which must start a block: a decode that
    already holds a prefix lists only the blocks it lacks. `HOLE` entries stay HOLE (the callers
    refuse a hole where a needed token sits)."""
    bs = layout.block_size
    if listed_from % bs:
        raise LayoutError(
            f"{side} block list starts at token {listed_from}, not on a {bs}-token block boundary"
        )
    if not 0 <= listed_from <= first_token < num_tokens:
        raise LayoutError(
            f"{side} token range [{first_token}, {num_tokens}) with blocks listed from token "
            f"{listed_from} is empty or starts before the list"
        )
    skip = first_token // bs - listed_from // bs  # listed blocks before the one holding first_token
    need = -(-num_tokens // bs) - listed_from // bs
    groups = {r.group for r in layout.regions}
    if max(groups) >= len(block_ids):
        raise LayoutError(f"{side} sent {len(block_ids)} block-id groups, layout uses group {max(groups)}")
    table = np.zeros((len(block_ids), need - skip), dtype=np.int64)
    limit = layout.regions[0].num_blocks
    for g in sorted(groups):
        ids = block_ids[g]
        if len(ids) < need:
            raise LayoutError(
                f"{side} group {g} has {len(ids)} blocks, tokens [{listed_from}, {num_tokens}) need {need}"
            )
        row = np.asarray(ids[skip:need], dtype=np.int64)
        bad = ((row < 0) & (row != HOLE)) | (row >= limit)
        if bad.any():
            raise LayoutError(f"{side} block id {int(row[bad][0])} out of range [0, {limit}) in group {g}")
        table[g] = row
    return table


def element_addresses(layout: KVLayout, block_ids: Sequence[Sequence[int]], num_tokens: int) -> np.ndarray:
    """Absolute byte address of every element of a request: layers x planes x heads x tokens x dims;
    `HOLE` for the tokens a windowed layer no longer keeps (`KVLayout.kept_from`).

    What the read-back checks use: two sides hold the same KV when the bytes at these addresses
    (through each side's own layout) are equal for the heads they share."""
    tab = block_table(layout, block_ids, num_tokens, "this side")
    tok = np.arange(num_tokens, dtype=np.int64)
    off = layout.block_offsets()  # P x H x bs x D
    in_block = off[:, :, tok % layout.block_size, :]  # P x H x T x D
    out = np.empty((len(layout.regions), *in_block.shape), dtype=np.int64)
    for i, r in enumerate(layout.regions):
        ids = tab[r.group][tok // layout.block_size]
        kept = tok >= layout.kept_from(r.group, 0, num_tokens)
        if (ids[kept] == HOLE).any():
            t = int(tok[kept][ids[kept] == HOLE][0])
            raise LayoutError(f"token {t} of group {r.group} is in a hole of this side's block list")
        out[i] = r.base + (ids * layout.block_stride)[None, None, :, None] + in_block
        out[i][:, :, ~kept, :] = HOLE
    return out


def plan(
    src: KVLayout,
    src_blocks: Sequence[Sequence[int]],
    dst: KVLayout,
    dst_blocks: Sequence[Sequence[int]],
    num_tokens: int,
    *,
    first_token: int = 0,
    merge: bool = True,
) -> Segments:
    """Every byte range the producer must write so the consumer holds tokens [first_token, num_tokens)
    of its KV for the shared heads.

    `src_blocks` hold the prompt from token 0; `dst_blocks` from `first_token` (the consumer already
    holds the tokens before it, e.g. its own prefix-cache hit, and lists only the blocks it lacks:
    `first_token` must start a consumer block; it may fall anywhere in a producer block).
    Tokens are cut into runs that stay inside one block on both sides; a run's in-block pattern
    depends only on where it starts in each side's block, so each pattern is computed once (element
    by element, coalesced) and stamped onto every run and layer by adding block and region bases.
    `merge=False` keeps each pattern's pieces apart (one descriptor per contiguous piece of a run)."""
    check_compatible(src, dst)
    if num_tokens <= 0:
        raise LayoutError(f"num_tokens must be positive, got {num_tokens}")
    s_tab = block_table(src, src_blocks, num_tokens, "producer", first_token=first_token)
    d_tab = block_table(
        dst, dst_blocks, num_tokens, "consumer", first_token=first_token, listed_from=first_token
    )
    # per group, the first token the consumer still needs (a window's tail; first_token otherwise)
    kept = {g: dst.kept_from(g, first_token, num_tokens) for g in {r.group for r in dst.regions}}
    starts, lens = token_runs(first_token, num_tokens, src.block_size, dst.block_size, cuts=kept.values())
    keys = np.stack([starts % src.block_size, starts % dst.block_size, lens], axis=1)
    parts: list[tuple[np.ndarray, ...]] = []
    for key in np.unique(keys, axis=0):
        every = np.flatnonzero((keys == key).all(axis=1))
        t_src, t_dst, t_len = _pattern(src, dst, *(int(k) for k in key), merge=merge)
        for i, (rs, rd) in enumerate(zip(src.regions, dst.regions, strict=True)):
            runs = every[starts[every] >= kept[rd.group]]
            if not runs.size:
                continue
            s_blk = starts[runs] // src.block_size - first_token // src.block_size
            d_blk = starts[runs] // dst.block_size - first_token // dst.block_size
            s_ids, d_ids = s_tab[rs.group][s_blk], d_tab[rd.group][d_blk]
            for side, ids in (("producer", s_ids), ("consumer", d_ids)):
                if (ids == HOLE).any():
                    t = int(starts[runs][ids == HOLE][0])
                    raise LayoutError(
                        f"{side} holds no block for token {t} of KV group {rd.group} (vLLM's null "
                        f"block), which the consumer needs (tokens from {kept[rd.group]})"
                    )
            s_base = rs.base + s_ids * src.block_stride
            d_base = rd.base + d_ids * dst.block_stride
            n = runs.size * t_len.size
            parts.append(
                (
                    (s_base[:, None] + t_src[None, :]).ravel(),
                    (d_base[:, None] + t_dst[None, :]).ravel(),
                    np.broadcast_to(t_len, (runs.size, t_len.size)).ravel(),
                    np.full(n, i, dtype=np.int64),
                )
            )
    if not parts:  # every layer's window ends before the range (a 1-token window): nothing to move
        empty = np.zeros(0, dtype=np.int64)
        return Segments(empty, empty.copy(), empty.copy(), empty.copy(), empty.copy())
    src_a, dst_a, ln, reg = (np.concatenate(c) for c in zip(*parts, strict=True))
    return Segments(src_a, dst_a, ln, reg, reg.copy())


def block_pairs(
    src: KVLayout,
    src_blocks: Sequence[Sequence[int]],
    dst: KVLayout,
    dst_blocks: Sequence[Sequence[int]],
    num_tokens: int,
    *,
    first_token: int = 0,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Block-aligned layouts (`block_aligned`): per region, the producer's and the consumer's ids of
    the whole blocks to copy, those holding tokens the consumer needs; a hole there is refused."""
    if not block_aligned(src, dst):
        raise LayoutError("whole-block copies need the same per-block layout on both sides")
    s_tab = block_table(src, src_blocks, num_tokens, "producer", first_token=first_token)
    d_tab = block_table(
        dst, dst_blocks, num_tokens, "consumer", first_token=first_token, listed_from=first_token
    )
    bs, skip = dst.block_size, first_token // dst.block_size
    s_out, d_out = [], []
    for rs, rd in zip(src.regions, dst.regions, strict=True):
        col = dst.kept_from(rd.group, first_token, num_tokens) // bs - skip
        s_ids, d_ids = s_tab[rs.group][col:], d_tab[rd.group][col:]
        for side, ids in (("producer", s_ids), ("consumer", d_ids)):
            if (ids == HOLE).any():
                b = int(np.flatnonzero(ids == HOLE)[0]) + col + skip
                raise LayoutError(
                    f"{side} holds no block for tokens [{b * bs}, {(b + 1) * bs}) of KV group "
                    f"{rd.group} (vLLM's null block), which the consumer needs"
                )
        s_out.append(s_ids)
        d_out.append(d_ids)
    return s_out, d_out


def missing_block(
    layout: KVLayout, block_ids: Sequence[Sequence[int]], num_tokens: int, *, first_token: int = 0
) -> str:
    """Why this side's blocks (listed from `first_token`) cannot hold the tokens a transfer of
    [first_token, num_tokens) needs: a hole (vLLM's null block) where a kept token sits; "" if none."""
    try:
        tab = block_table(
            layout, block_ids, num_tokens, "this side", first_token=first_token, listed_from=first_token
        )
    except LayoutError as exc:
        return str(exc)
    bs, skip = layout.block_size, first_token // layout.block_size
    for g in sorted({r.group for r in layout.regions}):
        col = layout.kept_from(g, first_token, num_tokens) // bs - skip
        holes = np.flatnonzero(tab[g][col:] == HOLE)
        if holes.size:
            b = int(holes[0]) + col + skip
            return f"vLLM gave its null block for tokens [{b * bs}, {(b + 1) * bs}) of KV group {g}"
    return ""


def token_runs(
    first_token: int, num_tokens: int, *block_sizes: int, cuts: Iterable[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of tokens [first_token, num_tokens) that stay inside one block of
    every given block size, also cut at each of `cuts` (inside the range)."""
    extra = [c for c in cuts if first_token < c < num_tokens]
    edges = [np.array([first_token, num_tokens, *extra], dtype=np.int64)]
    for bs in block_sizes:
        edges.append(np.arange(first_token - first_token % bs + bs, num_tokens, bs, dtype=np.int64))
    bounds = np.unique(np.concatenate(edges))
    return bounds[:-1], np.diff(bounds)


def pushed_blocks(dst: KVLayout, first_token: int, num_tokens: int) -> int:
    """Consumer blocks a transfer of tokens [first_token, num_tokens) writes into (per layer)."""
    return -(-num_tokens // dst.block_size) - first_token // dst.block_size


def _pattern(src: KVLayout, dst: KVLayout, s0: int, d0: int, n: int, *, merge: bool) -> Pieces:
    """In-block (src offset, dst offset, length) pieces for a run of n tokens starting at token s0
    of a producer block and d0 of a consumer block, all planes and shared heads."""
    cache_key = (dst.fingerprint, s0, d0, n, merge)
    hit = src._pieces.get(cache_key)
    if hit is not None:
        return hit
    lo, hi = max(src.head_offset, dst.head_offset), min(src.heads().stop, dst.heads().stop)
    chunk = math.gcd(_dim_chunk(src), _dim_chunk(dst))
    dims = np.arange(0, src.head_dim, chunk)
    s_off = src.block_offsets()[:, lo - src.head_offset : hi - src.head_offset, s0 : s0 + n][..., dims]
    d_off = dst.block_offsets()[:, lo - dst.head_offset : hi - dst.head_offset, d0 : d0 + n][..., dims]
    length = np.full(s_off.size, chunk * src.elem_bytes, dtype=np.int64)
    piece = (
        _merge_runs(s_off.ravel(), d_off.ravel(), length) if merge else (s_off.ravel(), d_off.ravel(), length)
    )
    if len(src._pieces) > 4096:  # bounded: patterns are few per peer (block-size ratio x run lengths)
        src._pieces.clear()
    src._pieces[cache_key] = piece
    return piece


def _dim_chunk(layout: KVLayout) -> int:
    """Largest run of consecutive dims that is contiguous in memory in every plane (divides head_dim)."""
    chunk = layout.head_dim
    for p in layout.planes:
        steps = np.diff(np.asarray(p.dim_offsets, dtype=np.int64)) == layout.elem_bytes
        breaks = np.flatnonzero(~steps) + 1
        edges = np.concatenate(([0], breaks, [layout.head_dim]))
        for length in np.diff(edges):
            chunk = math.gcd(chunk, int(length))
        for b in breaks:
            chunk = math.gcd(chunk, int(b))
    return max(chunk, 1)


def _merge_runs(src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> Pieces:
    """Merge pieces contiguous on both sides (sorted by source address first)."""
    order = np.argsort(src, kind="stable")
    src, dst, ln = src[order], dst[order], ln[order]
    joins = (src[:-1] + ln[:-1] == src[1:]) & (dst[:-1] + ln[:-1] == dst[1:])
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[heads], dst[heads], np.add.reduceat(ln, heads)


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
