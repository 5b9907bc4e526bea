"""vLLM glue: host staging of the KV cache, for GPU nodes without GPUDirect RDMA (`kv_buffer_device: cpu`).

NIXL then registers a host mirror of the cache instead of VRAM: every layer tensor gets a host twin
with the same shape, strides and storage offset (one host buffer per device storage, so layer views
that share a backing buffer keep sharing it), hence the same measured layout at other addresses. The
producer copies a request's blocks device -> host before its WRITE; the consumer copies host ->
device after the KV landed and before vLLM learns it was received. Copies go on the current stream
in runs of consecutive blocks; `copy_*` returns a CUDA event the worker polls (never waits on), or
None when the copy was synchronous (host caches: tests force staging there with `host_staging`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvferry.connector.layout import KVLayout, Region

if TYPE_CHECKING:
    import torch


def block_runs(ids: list[int]) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive block ids, in the order given; holes (-1, no block of the
    request's) are skipped."""
    runs: list[tuple[int, int]] = []
    for b in ids:
        if b < 0:
            continue
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


class HostStage:
    """Host twins of the device KV tensors and the copies between them."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], groups: list[int]) -> None:
        import torch

        self.device = list(kv_caches.values())
        self.groups = groups
        buffers: dict[int, torch.Tensor] = {}
        self.host: list[torch.Tensor] = []
        for t in self.device:
            storage = t.untyped_storage()
            raw = buffers.get(storage.data_ptr())
            if raw is None:  # zeroed, pinned for async copies when the cache is on a GPU
                raw = torch.zeros(storage.nbytes(), dtype=torch.uint8, pin_memory=t.is_cuda)
                buffers[storage.data_ptr()] = raw
            self.host.append(torch.as_strided(raw.view(t.dtype), t.shape, t.stride(), t.storage_offset()))
        self.on_gpu = self.device[0].is_cuda

    def rebase(self, layout: KVLayout) -> KVLayout:
        """The same layout over the host twins: what NIXL registers and peers write into."""
        regions = tuple(
            Region(h.data_ptr(), r.num_blocks, r.group)
            for h, r in zip(self.host, layout.regions, strict=True)
        )
        return dataclasses.replace(layout, regions=regions, memory="DRAM", device_id=0)

    def to_host(self, block_ids: list[list[int]]) -> Any:
        return self._copy(block_ids, to_device=False)

    def to_device(self, block_ids: list[list[int]]) -> Any:
        return self._copy(block_ids, to_device=True)

    def _copy(self, block_ids: list[list[int]], *, to_device: bool) -> Any:
        runs = [block_runs(ids) for ids in block_ids]
        for dev, host, group in zip(self.device, self.host, self.groups, strict=True):
            dst, src = (dev, host) if to_device else (host, dev)
            for a, b in runs[group]:
                dst[a:b].copy_(src[a:b], non_blocking=self.on_gpu)
        if not self.on_gpu:
            return None
        import torch

        event = torch.cuda.Event()
        event.record()
        return event
