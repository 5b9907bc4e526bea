"""vLLM glue, facade: `KvferryConnector`, loaded by vLLM 0.32 through kv_connector_module_path.

Each method checks the role and delegates: scheduler-side hooks to `KvferryScheduler`
(scheduler.py), worker-side hooks to `KvferryWorker` (worker.py). Metrics travel from the workers to
vLLM's /metrics as a journal inside `KvferryStats`, replayed by `KvferryPromMetrics` in the API server.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvferry.connector import metrics as M
from kvferry.connector.config import KvferryConfig
from kvferry.connector.scheduler import KvferryMetadata, KvferryScheduler
from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def share_vllm_log_handlers() -> None:
    """vLLM configures handlers on its own `vllm` logger only: without this, the connector's INFO lines
    (the measured KV layout at start-up) are dropped and only WARNING+ reach stderr."""
    ours, theirs = logging.getLogger("kvferry"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        share_vllm_log_handlers()
        tc = vllm_config.kv_transfer_config
        self.cfg = KvferryConfig.from_extra(tc.kv_connector_extra_config)
        self._scheduler: KvferryScheduler | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvferryScheduler(
                self.cfg, tc.is_kv_producer, early_handoff(vllm_config), group_windows(kv_cache_config)
            )
        else:
            from kvferry.connector.worker import KvferryWorker  # NIXL is imported by workers only

            self._worker = KvferryWorker(vllm_config, self.cfg, kv_cache_config)

    @property
    def sched(self) -> KvferryScheduler:
        assert self._scheduler is not None, "scheduler-side method called on a worker connector"
        return self._scheduler

    @property
    def work(self) -> Any:
        assert self._worker is not None, "worker-side method called on a scheduler connector"
        return self._worker

    # ---- scheduler side ----
    def on_new_request(self, request: Request) -> None:
        self.sched.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.sched.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.sched.has_pending_push_work()

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.work.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvferryMetadata)
        t0 = time.perf_counter()
        self.work.on_step(connector_metadata)  # before the forward pass, unlike start_load_kv here
        self.work.cost.add(time.perf_counter() - t0)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # done in bind_connector_metadata: vLLM 0.32 calls this after the forward pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole-request push: nothing is loaded layer by layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # the producer writes whole requests after the forward pass (wait_for_save)

    def wait_for_save(self) -> None:
        t0 = time.perf_counter()
        self.work.after_forward()
        self.work.cost.add(time.perf_counter() - t0)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        t0 = time.perf_counter()
        try:
            return self.work.get_transfer_results()
        finally:
            self.work.cost.step(time.perf_counter() - t0)  # once per engine step

    def get_kv_connector_stats(self) -> KvferryStats | None:
        if self._worker is None:  # vLLM also asks the scheduler-side instance; its stats come from workers
            return None
        journal = self._worker.take_journal()
        return KvferryStats(data={"journal": journal}) if journal else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- metrics plumbing (API-server process) ----
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvferryStats:
        return KvferryStats(data=dict(data) if data else {"journal": []})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def group_windows(kv_cache_config: Any) -> tuple[int, ...]:
    """Each KV group's sliding window (0: full attention); () when vLLM gave no config."""
    from kvferry.connector.kvcache import layer_spec, spec_window

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(spec_window(layer_spec(g.kv_cache_spec)) for g in groups)


def early_handoff(vllm_config: VllmConfig) -> bool:
    """Push a prefill right after its forward pass (scheduler.py): where the request finishes in the same
    step's output (no async scheduling, no pipeline). On CUDA the worker gates each hand-off on an
    event recorded after the forward (worker.after_forward)."""
    return (
        vllm_config.device_config.device_type in ("cpu", "cuda")
        and not vllm_config.scheduler_config.async_scheduling
        and vllm_config.parallel_config.pipeline_parallel_size == 1
    )


@dataclass
class KvferryStats(KVConnectorStats):
    """A journal of metric updates ([attr, labels, value]) from the workers since the last step."""

    def reset(self) -> None:
        self.data = {"journal": []}

    def aggregate(self, other: KVConnectorStats) -> KvferryStats:
        self.data.setdefault("journal", []).extend(other.data.get("journal", []))
        return self

    def reduce(self) -> dict[str, int | float]:
        journal = self.data.get("journal", [])
        counts: dict[str, int | float] = {}
        for attr, _, value in journal:
            if attr in ("transfers", "failures", "rejected", "bytes"):
                counts[attr] = counts.get(attr, 0) + value
        return counts

    def is_empty(self) -> bool:
        return not self.data.get("journal")


class KvferryPromMetrics(KVConnectorPromMetrics):
    """The kvferry_ metrics on vLLM's /metrics, labelled like vLLM's own (model_name, engine)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        kinds = {
            Counter: metric_types[Counter],
            Histogram: metric_types[Histogram],
            Gauge: metric_types[Gauge],
        }
        self._metrics = M.build(kinds, None, tuple(labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = tuple(self.per_engine_labelvalues.get(engine_idx, ()))
        M.apply(self._metrics, transfer_stats_data.get("journal", []), values)
