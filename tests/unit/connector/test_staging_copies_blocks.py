"""staging.HostStage: host twins keep the measured layout, and the copies move exactly a request's blocks."""

from __future__ import annotations

import torch
from kvferry.connector.kvcache import read_elements
from kvferry.connector.staging import HostStage, block_runs
from kvferry.tools.hostkv import CacheShape
from kvferry.tools.vllmkv import VllmKV


def test_block_runs_follow_the_given_order():
    assert block_runs([3, 4, 5, 9, 1, 2]) == [(3, 6), (9, 10), (1, 3)]
    assert block_runs([]) == []


def _staged(order: str) -> tuple[VllmKV, HostStage]:
    kv = VllmKV(
        CacheShape(
            layers=2, heads=2, head_dim=32, num_blocks=8, block_size=32, order=order, dtype="bfloat16"
        ),
        0,
    )
    return kv, HostStage({f"l{i}": t for i, t in enumerate(kv.tensors)}, [0, 0])


def test_round_trip_through_the_host_twin_moves_exactly_the_requests_blocks():
    for order in ("cpu/vec", "cuda/FLASH_ATTN/BLNHC"):
        kv, stage = _staged(order)
        twin = stage.rebase(kv.layout)
        sig, twin_sig = kv.layout.signature(), twin.signature()
        assert sig.pop("memory") == twin_sig.pop("memory") == "DRAM" and sig == twin_sig
        blocks, n = [5, 2, 3], 70
        kv.fill(blocks, n)
        assert stage.to_host([blocks]) is None  # host caches: synchronous
        assert (read_elements(twin, [blocks], n) == kv.gather(blocks, n)).all()
        assert not stage.host[0][[0, 1, 4, 6, 7]].any()  # no other block copied
        for t in kv.tensors:
            t.zero_()
        stage.to_device([blocks])
        assert kv.mismatches(blocks, n) == 0


def test_views_sharing_one_device_buffer_share_one_host_buffer():
    kv, stage = _staged("cuda/FLASH_ATTN/BLNHC")
    ptrs = {h.untyped_storage().data_ptr() for h in stage.host}
    assert len(ptrs) == 1 and stage.host[1].data_ptr() - stage.host[0].data_ptr() == kv.layout.page_bytes
    assert isinstance(stage.host[0], torch.Tensor) and stage.host[0].stride() == kv.tensors[0].stride()
