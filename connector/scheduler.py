"""vLLM glue, scheduler side: turn request lifecycle hooks into per-step metadata for the workers.

Runs in vLLM's engine-core process. It decides nothing about transfers (protocol.py does, on the
workers); it validates the kvferry params, records what each worker must do this step, and keeps the
few sets vLLM needs: requests waiting for KV, and finished prefills whose blocks are held.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.connector.config import KvferryConfig
from kvferry.connector.params import ConsumerParams, ParamsError, ProducerParams, parse, wants_transfer
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
PUSHED_STATUSES = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class Expect:
    req_id: str
    params: ConsumerParams
    block_ids: list[list[int]]
    num_tokens: int


@dataclass
class Finished:
    req_id: str
    params: ProducerParams
    block_ids: list[list[int]]
    num_tokens: int


@dataclass
class KvferryMetadata(KVConnectorMetadata):
    """One step's work for every worker (the same for all TP ranks)."""

    expects: list[Expect] = field(default_factory=list)  # consumer: register and wait
    invalid: list[tuple[str, str]] = field(default_factory=list)  # consumer: fail at once (req_id, why)
    finished: list[Finished] = field(default_factory=list)  # producer: hand blocks over
    aborted: list[tuple[str, int]] = field(default_factory=list)  # either: (request_id, attempt) gave up


class KvferryScheduler:
    def __init__(self, cfg: KvferryConfig, is_producer: bool) -> None:
        self.cfg, self.is_producer = cfg, is_producer
        self._step = KvferryMetadata()
        self._registered: dict[str, ConsumerParams | None] = {}  # consumer: req_id -> params (None: invalid)
        self._holding: dict[str, float] = {}  # producer: req_id -> time after which we stop stepping for it

    # ---- consumer ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.is_producer or wants_transfer(request.kv_transfer_params) != "consumer":
            return 0, False
        if request.request_id in self._registered:
            return 0, False  # KV already arrived (or failed): a re-schedule computes the rest locally
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        # Async even when the params are bad: the worker then reports the failure and vLLM applies
        # kv_load_failure_policy to this one request, instead of an exception in the engine loop.
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.is_producer or num_external_tokens <= 0 or request.request_id in self._registered:
            return
        try:
            params = parse(request.kv_transfer_params or {}, "consumer", self.cfg.deadline_s)
        except ParamsError as exc:
            log.error("kvferry: rejecting request %s: %s", request.request_id, exc)
            self._registered[request.request_id] = None
            self._step.invalid.append((request.request_id, str(exc)))
            return
        self._registered[request.request_id] = params
        block_ids = [list(g) for g in blocks.get_block_ids()]
        num_tokens = request.num_computed_tokens + num_external_tokens
        self._step.expects.append(Expect(request.request_id, params, block_ids, num_tokens))

    # ---- both ----
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvferryMetadata:
        step, self._step = self._step, KvferryMetadata()
        return step

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        if not self.is_producer:
            params = self._registered.pop(request.request_id, None)
            if params is not None and request.status == RequestStatus.FINISHED_ABORTED:
                # Still possibly waiting for KV: the worker cancels and reports it (bounded by the deadline).
                self._step.aborted.append((params.request_id, params.attempt))
            return False, None
        if wants_transfer(request.kv_transfer_params) != "producer":
            return False, None
        try:
            params = parse(request.kv_transfer_params or {}, "producer", self.cfg.deadline_s)
        except ParamsError as exc:
            log.error("kvferry: prefill %s will not push its KV: %s", request.request_id, exc)
            return False, {"kvferry_error": str(exc)}
        if request.status not in PUSHED_STATUSES:
            self._step.aborted.append((params.request_id, params.attempt))  # consumers fail fast
            return False, None
        num_tokens = len(request.prompt_token_ids or ())
        self._step.finished.append(
            Finished(request.request_id, params, [list(g) for g in block_ids], num_tokens)
        )
        self._holding[request.request_id] = time.monotonic() + self.cfg.lease_s + 5.0
        return True, {
            "kvferry": {"request_id": params.request_id, "attempt": params.attempt, "pushing": True}
        }

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_sending or ():
            self._holding.pop(req_id, None)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping (so results are collected) only while a push is pending, and never
        past its lease: an idle P must not spin on an unanswered request."""
        now = time.monotonic()
        for req_id in [r for r, until in self._holding.items() if until < now]:
            del self._holding[req_id]
        return bool(self._holding)

    def pending(self) -> dict[str, Any]:
        return {"registered": len(self._registered), "holding": len(self._holding)}
