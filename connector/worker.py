"""vLLM glue, worker side: describe this rank's KV cache, feed the endpoint, report its results.

Runs on each TP worker's main thread and never blocks: commands go to the endpoint thread (which
alone owns NIXL), results are taken without waiting. vLLM request ids are mapped to kvferry keys
(request_id, attempt) here and nowhere else.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvferry.connector.config import KvferryConfig
from kvferry.connector.endpoint import Endpoint, Key
from kvferry.connector.layout import KVLayout
from kvferry.connector.metrics import Metrics
from kvferry.connector.scheduler import Finished, KvferryMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class UnsupportedCacheError(RuntimeError):
    """A KV cache tensor kvferry cannot describe; the message names the layer and shape."""


def describe_cache(
    kv_caches: dict[str, torch.Tensor],
    layer_groups: dict[str, int],
    *,
    head_dim: int,
    total_heads: int,
    tp_rank: int,
    tp_size: int,
) -> tuple[KVLayout, int]:
    """This rank's KVLayout (vLLM CPU: per block, per head, K tokens then V tokens) and kernel block size."""
    tensors = list(kv_caches.items())
    name, first = tensors[0]
    nb, heads = first.shape[0], first.shape[1]
    per_head = first[0, 0].numel()
    if per_head % (2 * head_dim) or heads * tp_size != total_heads:
        raise UnsupportedCacheError(
            f"KV cache {name} of shape {tuple(first.shape)} is not [blocks, heads, ...] "
            f"with {total_heads // tp_size} heads of 2 x {head_dim} per token"
        )
    for lname, t in tensors:
        if t.shape != first.shape or not t.is_contiguous() or t.dtype != first.dtype:
            raise UnsupportedCacheError(
                f"KV cache {lname}: shape {tuple(t.shape)}, contiguous={t.is_contiguous()}"
                f", dtype {t.dtype}; expected the same as {name}"
            )
    layout = KVLayout.head_major(
        bases=[t.data_ptr() for _, t in tensors],
        num_blocks=nb,
        block_size=per_head // (2 * head_dim),
        num_heads=total_heads,
        head_dim=head_dim,
        elem_bytes=first.element_size(),
        tp_rank=tp_rank,
        tp_size=tp_size,
        groups=[layer_groups.get(n, 0) for n, _ in tensors],
    )
    if layout.region_bytes != first.numel() * first.element_size():
        raise UnsupportedCacheError(
            f"KV cache {name}: layout covers {layout.region_bytes} bytes, tensor has "
            f"{first.numel() * first.element_size()}"
        )
    return layout, layout.block_size


class KvferryWorker:
    def __init__(self, vllm_config: VllmConfig, cfg: KvferryConfig, kv_cache_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.vllm_config, self.cfg = vllm_config, cfg
        self.is_producer = vllm_config.kv_transfer_config.is_kv_producer
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.groups = {n: i for i, g in enumerate(kv_cache_config.kv_cache_groups) for n in g.layer_names}
        self.metrics = Metrics(journal=True)
        self.endpoint: Endpoint | None = None
        self._ratio = 1  # kernel blocks per logical block
        self._req_of: dict[Key, str] = {}  # kvferry key -> vLLM request id, until its result
        self._failed_now: list[tuple[str, str]] = []
        self._early: list[Finished] = []  # this step's prefills to hand over after the forward pass
        self._bound: KvferryMetadata | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self.vllm_config.model_config
        layout, kernel_block = describe_cache(
            kv_caches,
            self.groups,
            head_dim=model.get_head_size(),
            total_heads=model.get_total_num_kv_heads(),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        self._ratio = max(1, self.vllm_config.cache_config.block_size // kernel_block)
        role = "producer" if self.is_producer else "consumer"
        self.endpoint = Endpoint(
            self.cfg,
            role=role,
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            layout=layout,
            metrics=self.metrics,
        ).start()
        log.info(
            "kvferry %s rank %d: %d layers, kernel block %d tokens, side channel %s:%d",
            role,
            self.tp_rank,
            len(layout.regions),
            kernel_block,
            self.cfg.side_channel_host,
            self.endpoint.side_port,
        )

    def _kernel_ids(self, groups: list[list[int]]) -> list[list[int]]:
        r = self._ratio
        return groups if r == 1 else [[b * r + i for b in g for i in range(r)] for g in groups]

    def on_step(self, meta: KvferryMetadata) -> None:
        """A step's metadata, as vLLM binds it before the forward pass: registrations and hand-offs go
        out now, not after this step's forward (which may be another request's whole prefill)."""
        if meta is self._bound:
            return  # bound again within the same step
        self._bound = meta
        ep = self.endpoint
        if ep is None:  # vLLM's start-up dummy runs come before register_kv_caches, with empty metadata
            work = meta.expects or meta.finished or meta.early or meta.aborted
            assert not work, "register_kv_caches() first"
            return
        self._early = list(meta.early)
        for e in meta.expects:
            p = e.params
            self._req_of[(p.request_id, p.attempt)] = e.req_id
            ep.expect(
                p.request_id,
                p.attempt,
                producer_engine=p.producer_engine,
                producer_host=p.producer_host,
                producer_port=p.producer_port,
                producer_tp=p.producer_tp,
                block_ids=self._kernel_ids(e.block_ids),
                num_tokens=e.num_tokens,
                deadline_s=p.deadline_s,
            )
        self._failed_now += meta.invalid
        for f in meta.finished:
            self._hand_over(f, "finished")
        for rid, attempt in meta.aborted:
            (ep.prefill_aborted if self.is_producer else ep.abort)(rid, attempt)

    def after_forward(self) -> None:
        """This step's forward pass has written the KV of its early prefills: push them now."""
        early, self._early = self._early, []
        for f in early:
            self._hand_over(f, "after_forward")

    def _hand_over(self, f: Finished, when: str) -> None:
        assert self.endpoint is not None
        self.metrics.record("handoffs", 1, when)
        p = f.params
        self._req_of[(p.request_id, p.attempt)] = f.req_id
        self.endpoint.prefill_finished(
            p.request_id, p.attempt, self._kernel_ids(f.block_ids), f.num_tokens, p.consumer_engine
        )

    def get_transfer_results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.endpoint is None:
            return out
        if self._req_of:
            self.endpoint.kick()  # something is in flight: progress it at this step's cadence
        r = self.endpoint.take_results()
        for key in r.sent + [k for k, _ in r.released]:
            if (req := self._req_of.pop(key, None)) is not None:
                out.finished_sending.add(req)
        for key in r.received:
            if (req := self._req_of.pop(key, None)) is not None:
                out.finished_recving.add(req)
        failed = [(self._req_of.pop(k, None), why) for k, why in r.failed] + self._failed_now
        self._failed_now = []
        for req, why in failed:
            if req is not None:
                log.warning(
                    "kvferry: KV for request %s not received (%s); kv_load_failure_policy applies", req, why
                )
                out.finished_recving.add(req)
                out.failed_recving.add(req)
        return out

    def take_journal(self) -> list[list[Any]]:
        return self.metrics.take_journal()

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
