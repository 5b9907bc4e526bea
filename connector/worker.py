"""vLLM glue, worker side: describe this rank's KV cache, feed the endpoint, report its results.

Runs on each TP worker's main thread and never blocks: commands go to the endpoint thread (which
alone owns NIXL), results are taken without waiting. vLLM request ids are mapped to kvferry keys
(request_id, attempt) here and nowhere else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvferry.connector.config import KvferryConfig
from kvferry.connector.endpoint import Endpoint, Key
from kvferry.connector.identity import model_digest
from kvferry.connector.kvcache import UnsupportedCacheError, describe_kv_caches, read_elements
from kvferry.connector.layout import KVLayout, LayoutError
from kvferry.connector.mapping import HOLE, missing_block
from kvferry.connector.metrics import Metrics
from kvferry.connector.scheduler import Finished, KvferryMetadata
from kvferry.connector.staging import HostStage
from kvferry.contracts import termination
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)
# consumer_rounds: step: how long a step waits for the round it asked for (a round takes well under
# 1 ms; a slower one's results come at the next step instead of holding this one)
STEP_ROUND_WAIT_S = 0.002


# What decides the weights and the tokenizer (vLLM's ModelConfig): P and D must agree on each
# (per-role extra args are outside the operator's revision). Not max_model_len, seed, names, tokens.
IDENTITY_FIELDS = (
    "model", "model_weights", "revision", "code_revision", "tokenizer", "tokenizer_revision",
    "tokenizer_mode", "dtype", "quantization", "hf_overrides", "model_impl",
)  # fmt: skip


def model_identity(vllm_config: Any) -> dict[str, str]:
    """The IDENTITY_FIELDS of `vllm_config`, as stable strings (a callable override by its name)."""
    import json

    model = vllm_config.model_config
    out = {}
    for name in IDENTITY_FIELDS:
        value = getattr(model, name, None)
        if callable(value) and not isinstance(value, type):
            value = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
        out[name] = json.dumps(value, sort_keys=True, default=str)
    return out


def _record_event() -> Any:
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def refuse_at_start(why: str, log_path: Path = Path("/dev/termination-log")) -> None:
    """Write why this engine cannot start to the container's termination log (Kubernetes keeps it in
    the pod status; the operator makes it TransferHealthy=False, PreflightFailed), where one exists."""
    log.error("kvferry: this engine cannot serve P/D: %s", why)
    if not log_path.exists():  # not in a container (tests, local runs): the log line above says it
        return
    try:
        with log_path.open("w") as out:
            out.write((termination.PREFLIGHT_FAILED + why)[: termination.MAX_CHARS])
    except OSError as exc:
        log.warning("kvferry: could not write %s: %s", log_path, exc)


class StepCost:
    """Time in the connector's hooks on vLLM's worker thread, summed and recorded once a second (one
    journal entry per step would ship stats to the API server at every step)."""

    def __init__(self, metrics: Metrics, role: str, every_s: float = 1.0) -> None:
        self.metrics, self.role, self.every_s = metrics, role, every_s
        self.seconds, self.steps, self.since = 0.0, 0, time.monotonic()

    def add(self, seconds: float) -> None:
        self.seconds += seconds

    def step(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1
        if time.monotonic() - self.since >= self.every_s:
            self.metrics.record("step_hook_seconds", self.seconds, self.role)
            self.metrics.record("steps", self.steps, self.role)
            self.seconds, self.steps, self.since = 0.0, 0, time.monotonic()


class KvferryWorker:
    def __init__(self, vllm_config: VllmConfig, cfg: KvferryConfig, kv_cache_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.vllm_config, self.cfg = vllm_config, cfg
        self.is_producer = vllm_config.kv_transfer_config.is_kv_producer
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.kv_cache_config = kv_cache_config
        self.metrics = Metrics(journal=True)
        self.cost = StepCost(self.metrics, "producer" if self.is_producer else "consumer")
        self.endpoint: Endpoint | None = None
        self._ratio = 1  # kernel blocks per logical block
        self._req_of: dict[Key, str] = {}  # kvferry key -> vLLM request id, until its result
        self._failed_now: list[tuple[str, str]] = []
        self._early: list[Finished] = []  # this step's prefills to hand over after the forward pass
        self._bound: KvferryMetadata | None = None
        self._on_gpu = False  # set from the measured layout: VRAM caches need completion events
        self._stage: HostStage | None = None  # kv_buffer_device cpu (or host_staging): host twins
        self._cache_layout: KVLayout | None = None  # the engine's own cache (the endpoint may use twins)
        self._gated: list[tuple[Any, Callable[[], None]]] = []  # (CUDA event, what to do once it passed)
        self._landed: set[str] = set()  # consumer: vLLM requests whose KV is in the engine's cache
        # staging / kv_dump_dir: all blocks, tokens, the blocks written (staged back to the device)
        self._expected: dict[Key, tuple[list[list[int]], int, list[list[int]]]] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Measure this rank's KV layout through vLLM's own attention backend (kvcache.py; refuses
        what it cannot place), register it with NIXL and start the endpoint thread."""
        try:
            layout = describe_kv_caches(
                kv_caches, self.vllm_config, self.kv_cache_config, tp_rank=self.tp_rank, tp_size=self.tp_size
            )
        except (UnsupportedCacheError, LayoutError) as exc:
            # Only the running engine can tell (its backend, its KV groups, TP against the model's KV
            # heads): say so where the operator reads it, instead of leaving a bare crash loop.
            refuse_at_start(f"kv_layout: {exc}")
            raise
        self._ratio = max(1, self.vllm_config.cache_config.block_size // layout.block_size)
        self._cache_layout, self._on_gpu = layout, layout.memory == "VRAM"
        buffer_device = getattr(self.vllm_config.kv_transfer_config, "kv_buffer_device", "cuda")
        if self.cfg.host_staging or (self._on_gpu and buffer_device == "cpu"):
            self._stage = HostStage(kv_caches, [r.group for r in layout.regions])
        role = "producer" if self.is_producer else "consumer"
        self.endpoint = Endpoint(
            self.cfg,
            role=role,
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            layout=self._stage.rebase(layout) if self._stage else layout,
            metrics=self.metrics,
            model_digest=model_digest(model_identity(self.vllm_config)),
        ).start()
        log.info(
            "kvferry %s rank %d: KV layout %s%s; side channel %s:%d",
            role,
            self.tp_rank,
            layout.describe(),
            "; staged through host memory" if self._stage else "",
            self.cfg.side_channel_host,
            self.endpoint.side_port,
        )

    def _kernel_ids(self, groups: list[list[int]]) -> list[list[int]]:
        r = self._ratio
        if r == 1:
            return groups
        return [[b * r + i if b != HOLE else HOLE for b in g for i in range(r)] for g in groups]

    def _lacking(self, kernel_ids: list[list[int]], first_token: int) -> list[list[int]]:
        """The blocks from the one holding `first_token` on (the endpoint refuses a first token that
        does not start a block: vLLM's local hits are whole blocks)."""
        assert self._cache_layout is not None
        skip = first_token // self._cache_layout.block_size
        return [g[skip:] for g in kernel_ids]

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
            if not self._claim((p.request_id, p.attempt), e.req_id):
                self._failed_now.append((e.req_id, "duplicate kvferry key"))
                continue
            blocks = self._kernel_ids(e.block_ids)
            lacking = self._lacking(blocks, e.first_token)
            assert self._cache_layout is not None
            if why := missing_block(self._cache_layout, lacking, e.num_tokens, first_token=e.first_token):
                # vLLM's allocation disagrees with what the window keeps: never register a block the
                # request does not own; recompute instead (kv_load_failure_policy)
                log.error("kvferry: request %s refused: %s", e.req_id, why)
                self.metrics.record("failures", 1, "consumer", "null_block")
                self._failed_now.append((e.req_id, "null_block"))
                continue
            self._req_of[(p.request_id, p.attempt)] = e.req_id
            if self.cfg.kv_dump_dir or self._stage:
                self._expected[(p.request_id, p.attempt)] = (blocks, e.num_tokens, lacking)
            if self.tp_rank == 0 and e.first_token:
                self.metrics.record("prefix_held", e.first_token)
            ep.expect(
                p.request_id,
                p.attempt,
                producer_engine=p.producer_engine,
                producer_host=p.producer_host,
                producer_port=p.producer_port,
                producer_tp=p.producer_tp,
                block_ids=lacking,
                num_tokens=e.num_tokens,
                deadline_s=p.deadline_s,
                first_token=e.first_token,
                token_ids=e.token_ids,
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
        """Give a finished prefill to the endpoint once its KV is where NIXL reads it. On a GPU the
        forward (and a staging copy) were only launched: the hand-off waits for a CUDA event recorded
        after them (polled each step, never waited on), so no WRITE reads KV not yet written."""
        blocks = self._kernel_ids(f.block_ids)
        event = self._stage.to_host(blocks) if self._stage else None
        if event is None and self._on_gpu and when == "after_forward":
            event = _record_event()
        self._after(event, lambda: self._hand_over_now(f, when, blocks))

    def _hand_over_now(self, f: Finished, when: str, blocks: list[list[int]]) -> None:
        assert self.endpoint is not None
        p = f.params
        if not self._claim((p.request_id, p.attempt), f.req_id):
            # Unreachable while the scheduler refuses duplicates (its key map mirrors ours); never
            # report it sent: an early hand-off's request may still be running on these blocks.
            return
        self.metrics.record("handoffs", 1, when)
        self._req_of[(p.request_id, p.attempt)] = f.req_id
        if self.cfg.kv_dump_dir:
            self._dump((p.request_id, p.attempt), blocks, f.num_tokens)
        self.endpoint.prefill_finished(
            p.request_id, p.attempt, blocks, f.num_tokens, p.consumer_engine, f.token_ids
        )

    def _claim(self, key: Key, req_id: str) -> bool:
        """The scheduler refuses duplicate keys; this catches one still held here (e.g. a receive in
        quarantine) so two vLLM requests never share one transfer."""
        owner = self._req_of.get(key, req_id)
        if owner != req_id:
            log.error("kvferry: request %s refused: key %s is still held by request %s", req_id, key, owner)
            self.metrics.record("failures", 1, "producer" if self.is_producer else "consumer", "duplicate")
        return owner == req_id

    def _received(self, key: Key) -> None:
        """The KV of `key` landed where NIXL writes: bring it into the engine's cache (staging), then
        let vLLM see it."""
        req, expected = self._req_of.pop(key, None), self._expected.pop(key, None)
        # Only the blocks written: the held prefix blocks' host twins hold nothing of this request.
        event = self._stage.to_device(expected[2]) if self._stage and expected else None

        def landed() -> None:
            if self.cfg.kv_dump_dir and expected:
                self._dump(key, expected[0], expected[1])
            if req is not None:
                self._landed.add(req)

        self._after(event, landed)

    def _after(self, event: Any, then: Callable[[], None]) -> None:
        if event is None:
            then()
        else:
            self._gated.append((event, then))

    def _release_gated(self) -> None:
        """Run what waited for GPU work that has now finished (in order)."""
        while self._gated and self._gated[0][0].query():
            self._gated.pop(0)[1]()

    def get_transfer_results(self) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        if self.endpoint is None:
            return out
        if self.endpoint.dead:  # never serve on with a transfer thread gone: fail the engine loudly
            raise RuntimeError(f"kvferry endpoint thread died ({self.endpoint.dead}); restart this engine")
        self._release_gated()
        if self._req_of or self._gated:  # something is in flight: progress it at this step's cadence
            if not self.is_producer and self.cfg.consumer_rounds == "step":
                self.endpoint.round_now(STEP_ROUND_WAIT_S)  # this step takes what the round found
            else:
                self.endpoint.kick()
        r = self.endpoint.take_results()
        for key in r.sent + [k for k, _ in r.released]:
            if (req := self._req_of.pop(key, None)) is not None:
                out.finished_sending.add(req)
        for key in r.received:
            self._received(key)
        out.finished_recving.update(self._landed)
        self._landed.clear()
        for k, _ in r.failed:
            self._expected.pop(k, None)
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

    def _dump(self, key: Key, blocks: list[list[int]], num_tokens: int) -> None:
        """kv_dump_dir: this request's KV as this rank holds it, for a read-back comparison."""
        import numpy as np

        layout = self._cache_layout  # the engine's own cache, where vLLM reads and writes the KV
        assert layout is not None
        role = "producer" if self.is_producer else "consumer"
        name = f"{key[0]}-{key[1]}-{role}-h{layout.head_offset}.npy"
        np.save(Path(self.cfg.kv_dump_dir) / name, read_elements(layout, blocks, num_tokens))

    def take_journal(self) -> list[list[Any]]:
        return self.metrics.take_journal()

    def shutdown(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
