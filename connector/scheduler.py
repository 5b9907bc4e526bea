"""vLLM glue, scheduler side: turn request lifecycle hooks into per-step metadata for the workers.

Runs in vLLM's engine-core process. It decides nothing about transfers (protocol.py does, on the
workers); it validates the kvferry params, records what each worker must do this step, and keeps the
few sets vLLM needs: requests waiting for KV, and finished prefills whose blocks are held.

Early hand-off: a prefill leg (max_tokens 1) whose whole prompt runs in one step is handed to the
workers in that step's metadata (`early`), and the worker starts the push right after the forward
pass (`wait_for_save`), instead of one engine step later from `request_finished`; under load that
next step is often another request's whole prefill. Only where it is safe without a device sync or
a reorder: CPU KV caches (the forward is synchronous), no async scheduling and no pipeline
parallelism (so the request finishes in that same step's output, before any later schedule can
touch its blocks). `request_finished` then only holds the blocks until the worker reports them sent.

Sliding windows: vLLM's KV manager keeps only a window's tail of a windowed group's blocks and
lists its shared null block where the window has passed, counting from the tokens it was told are
computed. A decode that loads the whole prompt is told all N are computed, then recomputes the last
one (to sample from it) with a window one token further back, into a block it already nulled.
So with any windowed group the last prompt token is decode's own, as vLLM's NixlConnector does for
Mamba: prefill computes and pushes N - 1 tokens (`on_new_request` shortens its prompt), decode loads
N - 1 and computes token N - 1 itself; both sides then keep exactly the window that token needs.
Prefill's own sampled token is then not the request's first token: its answer says so (`tail`).
Null blocks become `HOLE` in every block list handed on, so nothing is ever read from or written
into them (mapping.py refuses a needed token in a hole).

Duplicate keys: a kvferry key (request_id, attempt) names one transfer. A second live request with
the key of another (a client replaying params, a buggy router) is refused here, the one place that
sees every request: on D it fails at once (kv_load_failure_policy), on P it frees its blocks without
a push. Otherwise one would decode on KV nobody wrote and the other's blocks would leak.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.connector.config import KvferryConfig
from kvferry.connector.mapping import HOLE
from kvferry.contracts.params import (
    TAIL,
    ConsumerParams,
    ParamsError,
    ProducerParams,
    parse,
    wants_transfer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
PUSHED_STATUSES = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
# vLLM's BlockPool takes block 0 as its shared null block (tests/unit/connector pins it).
NULL_BLOCK_ID = 0


def with_holes(block_ids: Any) -> list[list[int]]:
    """Block ids per group with vLLM's null block as HOLE (it holds no request's KV)."""
    return [[HOLE if b == NULL_BLOCK_ID else b for b in g] for g in block_ids]


@dataclass
class Expect:
    req_id: str
    params: ConsumerParams
    block_ids: list[list[int]]  # all of the request's blocks, from token 0
    num_tokens: int
    first_token: int = 0  # D already holds the tokens before it (its own prefix-cache hit)
    token_ids: list[int] | None = None  # the first num_tokens prompt tokens (identity.py digests them)


@dataclass
class Finished:
    req_id: str
    params: ProducerParams
    block_ids: list[list[int]]
    num_tokens: int
    token_ids: list[int] | None = None  # the prompt's first num_tokens, for decode's digest to match


def prompt_ids(request: Request, num_tokens: int) -> list[int] | None:
    """The first `num_tokens` prompt token ids (None for a prompt given as embeddings)."""
    ids = request.prompt_token_ids
    return None if ids is None else list(ids[:num_tokens])


@dataclass
class KvferryMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is read as Any (pyproject)
    """One step's work for every worker (the same for all TP ranks)."""

    expects: list[Expect] = field(default_factory=list)  # consumer: register and wait
    invalid: list[tuple[str, str]] = field(default_factory=list)  # consumer: fail at once (req_id, why)
    finished: list[Finished] = field(default_factory=list)  # producer: hand blocks over
    early: list[Finished] = field(default_factory=list)  # producer: hand over after this step's forward
    aborted: list[tuple[str, int]] = field(default_factory=list)  # either: (request_id, attempt) gave up


class KvferryScheduler:
    def __init__(
        self,
        cfg: KvferryConfig,
        is_producer: bool,
        early_handoff: bool = False,
        windows: tuple[int, ...] = (),
    ) -> None:
        self.cfg, self.is_producer, self.early_handoff = cfg, is_producer, early_handoff
        # prompt tokens decode computes itself: the last one, where a group keeps only a window
        self.tail = 1 if any(windows) else 0
        self._step = KvferryMetadata()
        self._candidates: dict[str, tuple[Request, list[list[int]]]] = {}  # producer: allocated this step
        self._early: dict[str, ProducerParams] = {}  # producer: handed over, request_finished not yet seen
        self._registered: dict[str, ConsumerParams | None] = {}  # consumer: req_id -> params (None: invalid)
        self._holding: dict[str, float] = {}  # producer: req_id -> time after which we stop stepping for it
        self._owner: dict[tuple[str, int], str] = {}  # live kvferry key -> the vLLM request that holds it
        self._hits: dict[str, int] = {}  # consumer: req_id -> its local prefix-cache hit, until allocated

    # ---- producer: prompt left to decode ----
    def on_new_request(self, request: Request) -> None:
        """Prefill computes the prompt but its last `tail` tokens (see the module docstring)."""
        prompt = request.prompt_token_ids
        if (
            not self.is_producer
            or not self.tail
            or wants_transfer(request.kv_transfer_params) != "producer"
            or prompt is None
            or request.num_prompt_tokens <= self.tail
            or request.get_skip_reading_prefix_cache()  # decode then loads nothing
        ):
            return
        del prompt[-self.tail :]
        del request._all_token_ids[-self.tail :]
        request.num_prompt_tokens -= self.tail
        request.max_tokens = 1

    # ---- consumer ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.is_producer or wants_transfer(request.kv_transfer_params) != "consumer":
            return 0, False
        if request.request_id in self._registered:
            return 0, False  # KV already arrived (or failed): a re-schedule computes the rest locally
        # tail > 0: the last prompt token is computed here (prefill pushes all but it)
        count = len(request.prompt_token_ids or ()) - self.tail - num_computed_tokens
        if count <= 0:
            return 0, False
        # D's own prefix-cache hit (whole blocks): only the tokens after it are registered and pushed.
        self._hits[request.request_id] = num_computed_tokens
        if len(self._hits) > self.cfg.max_entries:  # asked but never allocated (e.g. aborted waiting)
            del self._hits[next(iter(self._hits))]
        # Async even when the params are bad: the worker then reports the failure and vLLM applies
        # kv_load_failure_policy to this one request, instead of an exception in the engine loop.
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.is_producer:
            if self._early_candidate(request):
                self._candidates[request.request_id] = (request, with_holes(blocks.get_block_ids()))
            return
        hit = self._hits.pop(
            request.request_id, len(request.prompt_token_ids or ()) - self.tail - num_external_tokens
        )
        if num_external_tokens <= 0 or request.request_id in self._registered:
            return
        try:
            params = parse(request.kv_transfer_params or {}, "consumer", self.cfg.deadline_s)
        except ParamsError as exc:
            log.error("kvferry: rejecting request %s: %s", request.request_id, exc)
            self._registered[request.request_id] = None
            self._step.invalid.append((request.request_id, str(exc)))
            return
        if not self._claim((params.request_id, params.attempt), request.request_id):
            self._registered[request.request_id] = None
            self._step.invalid.append((request.request_id, "duplicate kvferry key"))
            return
        self._registered[request.request_id] = params
        block_ids = with_holes(blocks.get_block_ids())
        # vLLM sets request.num_computed_tokens only after this call: the hit is what it asked us with.
        num_tokens = hit + num_external_tokens
        expect = Expect(
            request.request_id, params, block_ids, num_tokens, hit, prompt_ids(request, num_tokens)
        )
        self._step.expects.append(expect)

    # ---- producer: early hand-off ----
    def _early_candidate(self, request: Request) -> bool:
        sampling = getattr(request, "sampling_params", None)
        return (
            self.early_handoff
            and request.num_computed_tokens == 0
            and sampling is not None
            and sampling.max_tokens == 1
            and wants_transfer(request.kv_transfer_params) == "producer"
        )

    def _take_early(self, scheduler_output: SchedulerOutput) -> list[Finished]:
        """Candidates whose whole prompt runs in this step (a chunked prefill goes the usual way)."""
        out = []
        for req_id, (request, block_ids) in self._candidates.items():
            num_tokens = len(request.prompt_token_ids or ())
            # P's own prefix-cache hit is not recomputed (num_computed_tokens is set by now); the push
            # still covers the whole prompt, which P's blocks hold.
            remaining = num_tokens - request.num_computed_tokens
            if scheduler_output.num_scheduled_tokens.get(req_id, 0) < remaining:
                continue
            try:
                params = parse(request.kv_transfer_params or {}, "producer", self.cfg.deadline_s)
            except ParamsError:
                continue  # request_finished reports it
            if not self._claim((params.request_id, params.attempt), req_id):
                continue  # request_finished refuses it
            out.append(Finished(req_id, params, block_ids, num_tokens, prompt_ids(request, num_tokens)))
            self._early[req_id] = params
        self._candidates.clear()
        return out

    # ---- both ----
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvferryMetadata:
        if self._candidates:
            self._step.early = self._take_early(scheduler_output)
        step, self._step = self._step, KvferryMetadata()
        return step

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not self.is_producer:
            self._receive_finished(request)
            return False, None
        return self._prefill_finished(request, block_ids)

    def _receive_finished(self, request: Request) -> None:
        self._hits.pop(request.request_id, None)
        params = self._registered.pop(request.request_id, None)
        if params is not None:
            self._release((params.request_id, params.attempt), request.request_id)
        if params is not None and request.status == RequestStatus.FINISHED_ABORTED:
            # Still possibly waiting for KV: the worker cancels, and vLLM keeps the blocks of an
            # aborted receive until the worker reports it (once every producer answered or is gone).
            self._step.aborted.append((params.request_id, params.attempt))

    def _prefill_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if wants_transfer(request.kv_transfer_params) != "producer":
            return False, None
        early = self._early.pop(request.request_id, None)
        if early is not None:
            # Already handed over (its KV is complete even if the request was aborted since): hold the
            # blocks until the worker reports the push sent or released.
            return self._hold(request.request_id, early)
        try:
            params = parse(request.kv_transfer_params or {}, "producer", self.cfg.deadline_s)
        except ParamsError as exc:
            log.error("kvferry: prefill %s will not push its KV: %s", request.request_id, exc)
            return False, {"kvferry_error": str(exc)}
        if not self._claim((params.request_id, params.attempt), request.request_id):
            return False, {"kvferry_error": "duplicate kvferry key"}  # blocks freed, nothing pushed
        if request.status not in PUSHED_STATUSES:
            self._release((params.request_id, params.attempt), request.request_id)
            self._step.aborted.append((params.request_id, params.attempt))  # consumers fail fast
            return False, None
        num_tokens = len(request.prompt_token_ids or ())
        ids = prompt_ids(request, num_tokens)
        self._step.finished.append(
            Finished(request.request_id, params, with_holes(block_ids), num_tokens, ids)
        )
        return self._hold(request.request_id, params)

    def _hold(self, req_id: str, params: ProducerParams) -> tuple[bool, dict[str, Any]]:
        self._holding[req_id] = time.monotonic() + self.cfg.lease_s + 5.0
        block: dict[str, Any] = {"request_id": params.request_id, "attempt": params.attempt, "pushing": True}
        if self.tail:  # this answer's token follows a shortened prompt: not the request's first token
            block[TAIL] = self.tail
        return True, {"kvferry": block}

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_sending or ():
            self._holding.pop(req_id, None)
        if self.is_producer and output.finished_sending:
            done = set(output.finished_sending)
            self._owner = {k: r for k, r in self._owner.items() if r not in done}

    def _claim(self, key: tuple[str, int], req_id: str) -> bool:
        """Make `req_id` the holder of `key`; False (logged) when another live request holds it."""
        owner = self._owner.setdefault(key, req_id)
        if owner != req_id:
            log.error(
                "kvferry: refusing request %s: kvferry key %s is in use by request %s", req_id, key, owner
            )
        return owner == req_id

    def _release(self, key: tuple[str, int], req_id: str) -> None:
        if self._owner.get(key) == req_id:
            del self._owner[key]

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping (so results are collected) only while a push is pending, and never
        past its lease: an idle P must not spin on an unanswered request."""
        now = time.monotonic()
        for req_id in [r for r, until in self._holding.items() if until < now]:
            del self._holding[req_id]
        return bool(self._holding)

    def pending(self) -> dict[str, Any]:
        return {
            "registered": len(self._registered),
            "holding": len(self._holding),
            "early": len(self._early),
            "keys": len(self._owner),
        }
