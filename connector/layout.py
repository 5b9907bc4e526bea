"""Layout step: where every KV element sits on each side, and which pairs of layouts can be mapped.

Pure arithmetic (numpy only, no NIXL, vLLM or torch). Each side describes its own KV cache as a
`KVLayout`, read from vLLM (connector/kvcache.py), never assumed; the producer maps its blocks onto
the consumer's element by element (mapping.py), so the two sides may use different block sizes, TP
sizes (heads split or merged) and in-block packings (vLLM-CPU's ISA-specific K packing, CUDA backends'
token- or head-major pages).

Byte address of element (token t, dim d) of plane p (K or V), local head h, in block b of layer l:

    regions[l].base + b * block_stride + h * head_stride
        + planes[p].offset + planes[p].token_offsets[t] + planes[p].dim_offsets[d]

A layout whose addresses are not of that separable form cannot be described, and so is refused
(kvcache.py raises before any transfer). Two layouts that disagree in anything a byte copy cannot
bridge (dtype, head_dim, planes, layer count, KV groups, heads) are refused by `check_compatible`
with both layouts named.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

# In-block (source offsets, destination offsets, lengths) of a run of tokens, all planes and shared heads.
Pieces = tuple[np.ndarray, np.ndarray, np.ndarray]


class LayoutError(ValueError):
    """A layout or block list that cannot be mapped; the message names what is wrong."""


@dataclass(frozen=True)
class Region:
    """One layer's KV memory on one rank."""

    base: int
    num_blocks: int
    group: int = 0  # KV cache group (HMA): which list of block ids addresses this region


@dataclass(frozen=True)
class PlaneMap:
    """One plane (K or V) of one head inside a block: byte offset of (token t, dim d) is
    `offset + token_offsets[t] + dim_offsets[d]`."""

    offset: int
    token_offsets: tuple[int, ...]
    dim_offsets: tuple[int, ...]

    def describe(self) -> str:
        """Short form: affine steps where the table is affine, else 'tiled'."""
        return f"@{self.offset} t{_steps(self.token_offsets)} d{_steps(self.dim_offsets)}"


def _steps(table: Sequence[int]) -> str:
    if len(table) < 2:
        return "[1]"
    step = table[1] - table[0]
    affine = all(b - a == step for a, b in zip(table, table[1:], strict=False))
    return f"*{step}" if affine else "[tiled]"


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV cache, element by element, as vLLM laid it out."""

    kind: str  # who declared it, e.g. "CPU_ATTN/vec LBHNC" or "FLASH_ATTN LBNHC"
    dtype: str  # element type as vLLM stores it ("float32", "bfloat16", "float8_e4m3fn", ...)
    block_size: int  # tokens per (kernel) block
    num_heads: int  # KV heads held by this rank
    head_offset: int  # global index of the first held head
    total_heads: int  # KV heads of the model
    head_dim: int
    elem_bytes: int
    head_stride: int  # bytes between heads inside a block
    block_stride: int  # bytes between consecutive blocks of one region
    planes: tuple[PlaneMap, ...]  # 2 (K, V); 1 for a latent cache
    regions: tuple[Region, ...]
    memory: str = "DRAM"  # NIXL memory type: DRAM (host) or VRAM (GPU)
    device_id: int = 0  # GPU index for VRAM
    # Per KV group (index = group id): its sliding window in tokens, 0 for full attention. A windowed
    # group holds only the window's tail; vLLM puts its shared null block where the window has passed.
    windows: tuple[int, ...] = ()
    # Derived once per layout: block offsets, and in-block pieces per (peer fingerprint, run).
    _cache: dict[str, np.ndarray] = field(
        default_factory=dict, init=False, compare=False, repr=False, hash=False
    )
    _pieces: dict[tuple[str, int, int, int, bool], Pieces] = field(
        default_factory=dict, init=False, compare=False, repr=False, hash=False
    )

    def __post_init__(self) -> None:
        for name in ("block_size", "num_heads", "total_heads", "head_dim", "elem_bytes", "block_stride"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"layout.{name} must be positive, got {getattr(self, name)}")
        if self.head_stride < 0:
            raise LayoutError(f"layout.head_stride must be >= 0, got {self.head_stride}")
        if not self.head_offset >= 0 or self.head_offset + self.num_heads > self.total_heads:
            raise LayoutError(
                f"layout heads [{self.head_offset}, {self.head_offset + self.num_heads}) "
                f"outside the model's {self.total_heads} KV heads"
            )
        if not self.planes:
            raise LayoutError("layout.planes is empty")
        for i, p in enumerate(self.planes):
            if len(p.token_offsets) != self.block_size or len(p.dim_offsets) != self.head_dim:
                raise LayoutError(
                    f"layout.planes[{i}] has {len(p.token_offsets)} token and {len(p.dim_offsets)} dim "
                    f"offsets for block_size {self.block_size}, head_dim {self.head_dim}"
                )
            if min(p.token_offsets) < 0 or min(p.dim_offsets) < 0 or p.offset < 0:
                raise LayoutError(f"layout.planes[{i}] has a negative offset")
        if not self.regions:
            raise LayoutError("layout.regions is empty")
        for i, r in enumerate(self.regions):
            if r.num_blocks <= 0 or r.base <= 0 or r.group < 0:
                raise LayoutError(f"layout.regions[{i}] is invalid: {r}")
        if len({r.num_blocks for r in self.regions}) != 1:
            raise LayoutError("layout.regions differ in num_blocks")
        if self.memory not in ("DRAM", "VRAM"):
            raise LayoutError(f"layout.memory must be DRAM or VRAM, got {self.memory!r}")
        if any(w < 0 for w in self.windows):
            raise LayoutError(f"layout.windows must be >= 0 tokens, got {list(self.windows)}")
        if self.windows and max(r.group for r in self.regions) >= len(self.windows):
            raise LayoutError(
                f"layout.windows has {len(self.windows)} groups, regions use group "
                f"{max(r.group for r in self.regions)}"
            )
        offsets = self.block_offsets()
        flat = np.sort(offsets.ravel())
        if flat.size > 1 and (np.diff(flat) < self.elem_bytes).any():
            raise LayoutError(f"layout {self.kind}: two elements of a block overlap")
        # pages may interleave with other layers' (cross-layer layouts), never with each other
        if self.page_bytes > self.block_stride and not _blocks_disjoint(
            flat, self.elem_bytes, self.block_stride
        ):
            raise LayoutError(f"layout {self.kind}: blocks overlap (block_stride {self.block_stride})")

    # ---- derived facts ----
    @property
    def num_planes(self) -> int:
        return len(self.planes)

    def heads(self) -> range:
        return range(self.head_offset, self.head_offset + self.num_heads)

    def window(self, group: int) -> int:
        """Group's sliding window in tokens (0: full attention, every token is kept)."""
        return self.windows[group] if group < len(self.windows) else 0

    def kept_from(self, group: int, first_token: int, num_tokens: int) -> int:
        """First token of [first_token, num_tokens) that the engine holding `num_tokens` tokens still
        attends to when it computes token `num_tokens` next: a windowed group needs only the last
        window - 1 of them (vLLM retires the blocks before that; both sides count the same way)."""
        w = self.window(group)
        return max(first_token, num_tokens - w + 1) if w else first_token

    def block_offsets(self) -> np.ndarray:
        """Byte offset of every element of one block, shape planes x heads x tokens x dims."""
        if "offsets" not in self._cache:
            tok = np.array([p.token_offsets for p in self.planes], dtype=np.int64)
            dim = np.array([p.dim_offsets for p in self.planes], dtype=np.int64)
            off = np.array([p.offset for p in self.planes], dtype=np.int64)
            heads = np.arange(self.num_heads, dtype=np.int64) * self.head_stride
            self._cache["offsets"] = (
                off[:, None, None, None]
                + heads[None, :, None, None]
                + tok[:, None, :, None]
                + dim[:, None, None, :]
            )
        return self._cache["offsets"]

    @property
    def page_bytes(self) -> int:
        """Bytes from a block's start to the end of its last element."""
        return int(self.block_offsets().max()) + self.elem_bytes

    @property
    def dense_page(self) -> bool:
        """A block is one run of bytes [start, start + page_bytes) holding only this block's KV."""
        n = self.block_offsets().size * self.elem_bytes
        return n == self.page_bytes and self.page_bytes <= self.block_stride

    @property
    def region_bytes(self) -> int:
        """Bytes one region spans from its base (what to register with NIXL)."""
        return (self.regions[0].num_blocks - 1) * self.block_stride + self.page_bytes

    def spans(self) -> list[tuple[int, int]]:
        """Registration spans: every region's bytes, overlapping ones (cross-layer layouts) merged."""
        out: list[list[int]] = []
        for start in sorted(r.base for r in self.regions):
            end = start + self.region_bytes
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return [(a, b - a) for a, b in out]

    def signature(self) -> dict[str, Any]:
        """Everything that decides where bytes go, without addresses (equal on equal engines)."""
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "heads": [self.head_offset, self.num_heads, self.total_heads],
            "head_dim": self.head_dim,
            "elem_bytes": self.elem_bytes,
            "head_stride": self.head_stride,
            "block_stride": self.block_stride,
            "planes": [[p.offset, list(p.token_offsets), list(p.dim_offsets)] for p in self.planes],
            "layers": len(self.regions),
            "groups": [r.group for r in self.regions],
            "windows": [self.window(g) for g in sorted({r.group for r in self.regions})],
            "memory": self.memory,
        }

    @cached_property
    def fingerprint(self) -> str:
        blob = json.dumps(self.signature(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        """One line naming the layout for logs and refusals."""
        planes = " ".join(
            f"{'KV'[i] if self.num_planes == 2 else 'L'}{p.describe()}" for i, p in enumerate(self.planes)
        )
        return (
            f"{self.kind} {self.dtype} block {self.block_size} heads {self.head_offset}+{self.num_heads}"
            f"/{self.total_heads} dim {self.head_dim} layers {len(self.regions)}{self._windowed()} "
            f"{self.memory} "
            f"[{planes}, head *{self.head_stride}, block *{self.block_stride}] #{self.fingerprint}"
        )

    def _windowed(self) -> str:
        wins = sorted({self.window(r.group) for r in self.regions} - {0})
        return f" windows {wins}" if wins else ""

    # ---- constructors ----
    @classmethod
    def from_offsets(
        cls, offsets: np.ndarray, *, block_stride: int, bases: Sequence[int], num_blocks: int, **kw: Any
    ) -> KVLayout:
        """Fit a layout to measured byte offsets (planes x local heads x tokens x dims) of one block.

        Raises LayoutError when they are not `plane + head * stride + token[t] + dim[d]`."""
        off = np.asarray(offsets, dtype=np.int64)
        if off.ndim != 4:
            raise LayoutError(f"offsets must be planes x heads x tokens x dims, got shape {off.shape}")
        n_planes, n_heads, bs, hd = off.shape
        head_stride = int(off[0, 1, 0, 0] - off[0, 0, 0, 0]) if n_heads > 1 else 0
        planes = []
        for p in range(n_planes):
            base = int(off[p, 0, 0, 0])
            tok = off[p, 0, :, 0] - base
            dim = off[p, 0, 0, :] - base
            if tok.min() < 0 or dim.min() < 0:
                raise LayoutError(f"plane {p}: token 0 / dim 0 is not the plane's first element")
            planes.append(PlaneMap(base, tuple(int(x) for x in tok), tuple(int(x) for x in dim)))
        layout = cls(
            block_size=bs,
            num_heads=n_heads,
            head_dim=hd,
            head_stride=head_stride,
            block_stride=block_stride,
            planes=tuple(planes),
            regions=regions_at(bases, num_blocks, kw.pop("groups", None)),
            **kw,
        )
        if not np.array_equal(layout.block_offsets(), off):
            bad = np.argwhere(layout.block_offsets() != off)[0].tolist()
            raise LayoutError(
                f"{kw.get('kind', 'layout')}: element (plane, head, token, dim)={tuple(bad)} is not at "
                "plane + head + token + dim offsets; kvferry cannot describe this packing"
            )
        return layout


def _blocks_disjoint(sorted_offsets: np.ndarray, elem: int, stride: int) -> bool:
    """True when a page placed every `stride` bytes never overlaps the next one."""
    shifted = np.sort(np.concatenate([sorted_offsets, sorted_offsets + stride]))
    return bool((np.diff(shifted) >= elem).all())


def regions_at(bases: Sequence[int], num_blocks: int, groups: Sequence[int] | None) -> tuple[Region, ...]:
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


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise LayoutError naming what makes two layouts unmappable, and both layouts."""
    why = _incompatibility(src, dst)
    if why:
        raise LayoutError(f"{why}; producer: {src.describe()}; consumer: {dst.describe()}")


def refusal(src: KVLayout, dst: KVLayout, registered: str | None = None) -> str:
    """Why the producer must not write into the consumer ("" when it may): the consumer registered
    against another layout than `dst` (fingerprint), or the layouts cannot be mapped."""
    if registered is not None and registered != dst.fingerprint:
        return f"registration was made for layout #{registered}, the consumer serves #{dst.fingerprint}"
    try:
        check_compatible(src, dst)
    except LayoutError as exc:
        return str(exc)
    return ""


def _incompatibility(src: KVLayout, dst: KVLayout) -> str:
    for name in ("dtype", "elem_bytes", "total_heads", "head_dim", "num_planes"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            return f"layouts differ in {name}: producer {a}, consumer {b}"
    if len(src.regions) != len(dst.regions):
        return f"layouts differ in layer count: producer {len(src.regions)}, consumer {len(dst.regions)}"
    for i, (a, b) in enumerate(zip(src.regions, dst.regions, strict=True)):
        if a.group != b.group:
            return f"layer {i} is in KV group {a.group} on the producer, {b.group} on the consumer"
        if src.window(a.group) != dst.window(b.group):
            return (
                f"layer {i} has a {src.window(a.group)}-token window on the producer, "
                f"{dst.window(b.group)} on the consumer (0: full attention)"
            )
    if max(src.head_offset, dst.head_offset) >= min(src.heads().stop, dst.heads().stop):
        return f"producer heads {src.heads()} and consumer heads {dst.heads()} do not overlap"
    return ""
