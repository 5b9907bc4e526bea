"""GPU check step: one TP rank's KV cache on the device, its measured layout, fill and comparison.

The layout is what the connector measures (kvcache.probe_offsets through the backend's write), not
the one pages.py built; the comparison reads every element through that layout on the device and
also checks the whole cache byte for byte against a fresh cache written with the same KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from kvferry.connector.kvcache import layout_from_tensors, probe_offsets
from kvferry.connector.layout import KVLayout, split_heads
from kvferry.connector.mapping import element_addresses
from kvferry.tools.gpucheck.pages import kv_views, page_bytes, scatter

if TYPE_CHECKING:
    import torch

ALIGN = 4096  # registration granularity: NIXL/UCX pin whole pages


@dataclass(frozen=True)
class Side:
    """One side's cache: the model (layers, heads, head_dim, src_dtype) is the same on both sides;
    backend, page order, KV dtype, block size and TP size are the side's own."""

    backend: str
    order: str
    block_size: int
    tp_size: int
    kv_dtype: str
    src_dtype: str = "bfloat16"
    layers: int = 4
    heads: int = 8
    head_dim: int = 128
    num_blocks: int = 64
    device: str = "cuda"  # cuda | cpu
    staged: bool = False  # host twins registered instead of the device cache

    def describe(self) -> str:
        return f"{self.backend}/{self.order} bs{self.block_size} tp{self.tp_size}"


class DeviceKV:
    """One TP rank's cache: one backing buffer viewed per layer as vLLM does."""

    def __init__(self, side: Side, tp_rank: int) -> None:
        import torch

        self.side, self.tp_rank = side, tp_rank
        self.dtype = getattr(torch, side.kv_dtype)
        self.src_dtype = getattr(torch, side.src_dtype)
        self.heads = split_heads(side.heads, tp_rank, side.tp_size)
        self.device = torch.device(side.device)
        elem = torch.empty((), dtype=self.dtype).element_size()
        size = (
            page_bytes(len(self.heads), side.block_size, side.head_dim, elem) * side.num_blocks * side.layers
        )
        self._store = torch.zeros(size + ALIGN, dtype=torch.int8, device=self.device)
        start = -self._store.data_ptr() % ALIGN
        self.raw = self._store[start : start + size]
        self.tensors = kv_views(
            self.raw, side.order, layers=side.layers, num_blocks=side.num_blocks, heads=len(self.heads),
            block_size=side.block_size, head_dim=side.head_dim, dtype=self.dtype,
        )  # fmt: skip
        self.write = scatter(side.head_dim)
        offsets = probe_offsets(
            self.write, self.tensors[0], num_heads=len(self.heads), head_dim=side.head_dim,
            src_dtype=self.src_dtype,
        )  # fmt: skip
        self.layout: KVLayout = layout_from_tensors(
            self.tensors, offsets, kind=f"{side.backend} {side.order}", total_heads=side.heads,
            tp_rank=tp_rank, tp_size=side.tp_size, groups=[0] * side.layers,
        )  # fmt: skip

    def values(self, num_tokens: int) -> torch.Tensor:
        """layers x planes x heads (this rank's) x tokens x dims in the model dtype, from global
        indices only (the same on every side and rank)."""
        import torch

        s = self.side
        layer, plane, head, tok, dim = np.ogrid[
            : s.layers, :2, self.heads.start : self.heads.stop, :num_tokens, : s.head_dim
        ]
        v = (layer * 1_000_003 + plane * 7_919 + head * 104_729 + tok * 613 + dim * 1_299_709) % 251
        return torch.from_numpy(((v - 125) / 8.0).astype(np.float32)).to(self.device, self.src_dtype)

    def fill(self, blocks: list[int], num_tokens: int) -> None:
        """Every layer's K and V of `num_tokens` tokens, through the backend's scatter."""
        import torch

        vals = self.values(num_tokens)
        tok = torch.arange(num_tokens, device=self.device)
        ids = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        slots = ids[tok // self.side.block_size] * self.side.block_size + tok % self.side.block_size
        for i, t in enumerate(self.tensors):
            key = vals[i, 0].transpose(0, 1).contiguous()  # tokens x heads x dim
            value = vals[i, 1].transpose(0, 1).contiguous()
            self.write(key, value, t, slots)

    def gather(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Element bytes read on the device through the measured layout (layers x planes x heads x
        tokens x dims x element bytes)."""
        import torch

        addr = element_addresses(self.layout, [blocks], num_tokens) - self.raw.data_ptr()
        e = self.layout.elem_bytes
        index = torch.from_numpy(addr).to(self.device)[..., None] + torch.arange(e, device=self.device)
        return self.raw.view(torch.uint8)[index]

    def mismatches(self, blocks: list[int], num_tokens: int) -> int:
        """Elements that differ from the producer's KV read through this rank's layout, plus page
        bytes of these blocks that differ from a fresh cache given the same KV by the scatter."""
        import torch

        want = self.values(num_tokens).to(self.dtype).contiguous().view(torch.uint8)
        got = self.gather(blocks, num_tokens).reshape(want.shape)
        ref = DeviceKV(self.side, self.tp_rank)
        ref.fill(blocks, num_tokens)
        ids = torch.tensor(blocks, device=self.device)
        pages = sum(
            int((mine.view(torch.uint8)[ids] != theirs.view(torch.uint8)[ids]).sum().item())
            for mine, theirs in zip(self.byte_views(), ref.byte_views(), strict=True)
        )
        return int((got != want).sum().item()) + pages

    def byte_views(self) -> list[torch.Tensor]:
        """Each layer's [B, H, N, C] view as bytes (fp8 has no comparison on every device)."""
        import torch

        return [t.view(torch.uint8) for t in self.tensors]
