"""Dispatch step: run one client request through prefill and decode legs, owning every deadline.

- kvferry and vllm-push: both legs start at once with one X-Request-Id (D registers while P computes).
  P's leg is bounded by prefill_s; D's first-token clock starts only when P's leg finished, so a slow
  P is never blamed on D (D cannot produce a token before its KV exists). kvferry with
  push.decode_start before-prefill: D's leg opens when the backlog estimate says P is about to start
  the request, or when P's leg ends, whichever is first.
- vllm-pull: P first, then D with P's returned kv_transfer_params verbatim.
- A failed or stuck leg (an error event before D's first token included) ends in a local recompute
  on the other engine of the pair (while time is left and the recompute budget allows) or in a clear
  OpenAI-style error; nothing waits without a bound.
- The prefill leg is never cancelled once D depends on it (that strands D waiting for KV): when the
  client goes away, P is left to finish in the background and D's connection is closed, which makes
  vLLM abort the decode request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from kvferry.router import bounded
from kvferry.router import params as legs
from kvferry.router.aggregate import can_aggregate, streaming_body
from kvferry.router.backlog import PrefillBacklog
from kvferry.router.budget import RecomputeBudget
from kvferry.router.config import Endpoint, RouterConfig
from kvferry.router.errors import RETRY_AFTER_S, ApiError, LegError
from kvferry.router.metrics import RouterMetrics
from kvferry.router.selection import LoadTracker
from kvferry.router.sse import FirstEvent, FirstEventScanner

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
# After P finished, D gets at least transfer_s plus this margin, so that the kvferry connector's own
# deadline_s (an error event from D, recomputed with a clear reason) acts before the router's bound.
KV_MARGIN_S = 5.0
# Engine answers read whole are capped: prefill's 1-token answer (prompt token ids included), and a
# non-streaming decode answer (logprobs included); an error body is read only as far as its message.
MAX_PREFILL_ANSWER_BYTES = 16 << 20
MAX_DECODE_ANSWER_BYTES = 64 << 20
MAX_ERROR_BYTES = 2000
OnPrefill = Callable[[dict[str, Any]], Awaitable[None]]  # gets P's answer before D's first token


@dataclass
class OpenLeg:
    """A decode-side answer that has started: status 200 and every byte read so far (a stream up to
    and including its first event with output; sse.py), all to be relayed unchanged."""

    engine: Endpoint
    response: aiohttp.ClientResponse
    first: bytes
    stream: bool
    aggregate: bool = False  # D streams, the client wants one JSON answer (see aggregate.py)
    recomputed: str | None = None  # reason, when this is a local recompute
    finished: bool = False  # closed and its slot freed (finish_leg runs once per leg)


class Dispatcher:
    """Runs requests for one router; shared by all handlers."""

    def __init__(
        self, cfg: RouterConfig, session: aiohttp.ClientSession, tracker: LoadTracker, metrics: RouterMetrics,
        backlog: PrefillBacklog,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.session = session
        self.tracker = tracker
        self.metrics = metrics
        self.backlog = backlog
        self.detached: set[asyncio.Task[Any]] = set()
        self.budget = RecomputeBudget(cfg.limits.recompute_ratio, cfg.limits.recompute_burst)

    # -- legs -------------------------------------------------------------------------------------

    def _begin(self, ep: Endpoint) -> None:
        self.tracker.begin(ep)
        self.metrics.in_flight.labels(ep.role, ep.engine_id).inc()

    def _end(self, ep: Endpoint) -> None:
        self.tracker.end(ep)
        self.metrics.in_flight.labels(ep.role, ep.engine_id).dec()

    def _fail(self, leg: str, reason: str, message: str, **kw: Any) -> LegError:
        self.metrics.leg_errors.labels(leg, reason).inc()
        log.warning("%s leg failed (%s): %s", leg, reason, message)
        return LegError(leg, reason, message, **kw)

    async def _post(self, ep: Endpoint, path: str, body: dict[str, Any], rid: str) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        return await self.session.post(
            ep.url + path, json=body, headers={"X-Request-Id": rid}, timeout=timeout
        )

    async def _status_error(self, leg: str, ep: Endpoint, resp: aiohttp.ClientResponse) -> LegError:
        text = (await bounded.read_prefix(resp, MAX_ERROR_BYTES)).decode(errors="replace")
        try:
            message = str(bounded.loads(text, "error body")["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = text
        resp.close()  # the rest of the body is not read
        reason = status_reason(resp.status)
        if 400 <= resp.status < 500:
            # The engine rejected the request itself (e.g. prompt too long): recompute cannot help.
            return self._fail(leg, reason, message, status=resp.status, retryable=False)
        return self._fail(leg, reason, f"{leg} {ep.engine_id} answered {resp.status}: {message}")

    async def prefill(
        self, ep: Endpoint, path: str, body: dict[str, Any], rid: str, timeout_s: float, tokens: int = 0
    ) -> dict[str, Any]:
        """Run the 1-token prefill leg of a `tokens`-token prompt (to compute: hits excluded); returns
        P's answer ({} when it was not a JSON object)."""
        self._begin(ep)
        loop, completed = asyncio.get_running_loop(), False
        self.backlog.started(ep.url, tokens, loop.time())
        try:
            answer = await asyncio.wait_for(self._prefill_once(ep, path, body, rid), timeout_s)
            completed = True
            return answer
        except asyncio.TimeoutError:
            self.tracker.mark_down(ep)  # slow P: steer the next requests elsewhere, recompute on D
            raise self._fail(
                "prefill",
                "timeout",
                f"prefill {ep.engine_id} did not finish within {timeout_s:.1f}s",
                status=504,
            ) from None
        except (aiohttp.ClientError, ValueError) as exc:
            self.tracker.mark_down(ep)
            raise self._fail("prefill", "unreachable", f"prefill {ep.engine_id} failed: {exc!r}") from None
        finally:
            self._end(ep)
            self.backlog.finished(ep.url, tokens, loop.time(), completed)

    async def _prefill_once(self, ep: Endpoint, path: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
        async with await self._post(ep, path, body, rid) as resp:
            if resp.status != 200:
                raise await self._status_error("prefill", ep, resp)
            what = f"prefill {ep.engine_id}'s answer"
            try:
                data = bounded.loads(await bounded.read_capped(resp, MAX_PREFILL_ANSWER_BYTES, what), what)
            except bounded.BoundError as exc:
                raise self._fail("prefill", "bad_answer", str(exc)) from None
        return data if isinstance(data, dict) else {}

    async def open_decode(
        self, ep: Endpoint, path: str, body: dict[str, Any], rid: str, stream: bool, timeout_s: float,
        aggregate: bool = False,
    ) -> OpenLeg:  # fmt: skip
        """Send the decode leg and read its first bytes (streaming) or whole body within timeout_s."""
        self._begin(ep)
        holder: list[aiohttp.ClientResponse] = []
        try:
            first = await asyncio.wait_for(self._decode_start(ep, path, body, rid, stream, holder), timeout_s)
            if not first:
                raise self._fail(
                    "decode", "empty", f"decode {ep.engine_id} closed the stream before any token"
                )
            return OpenLeg(ep, holder[0], first, stream, aggregate)
        except BaseException as exc:
            if holder:
                holder[0].close()  # closing the connection makes vLLM abort the request
            self._end(ep)
            if isinstance(exc, asyncio.TimeoutError):
                self.tracker.mark_down(ep)
                what = "first token" if stream else "answer"
                raise self._fail(
                    "decode",
                    "timeout",
                    f"decode {ep.engine_id} gave no {what} within {timeout_s:.1f}s",
                    status=504,
                ) from None
            if isinstance(exc, aiohttp.ClientError):
                self.tracker.mark_down(ep)
                raise self._fail("decode", "unreachable", f"decode {ep.engine_id} failed: {exc!r}") from None
            raise

    async def _decode_start(
        self, ep: Endpoint, path: str, body: dict[str, Any], rid: str, stream: bool, holder: list[Any]
    ) -> bytes:
        resp = await self._post(ep, path, body, rid)
        holder.append(resp)
        if resp.status != 200:
            raise await self._status_error("decode", ep, resp)
        if stream:
            return await self._first_event(ep, resp)
        what = f"decode {ep.engine_id}'s answer"
        try:
            return await bounded.read_capped(resp, MAX_DECODE_ANSWER_BYTES, what)
        except bounded.BoundError as exc:
            raise self._fail("decode", "bad_answer", str(exc), retryable=False) from None

    async def _first_event(self, ep: Endpoint, resp: aiohttp.ClientResponse) -> bytes:
        """Read D's stream up to its first event with output; an error event before it fails the leg."""
        scanner, read = FirstEventScanner(), bytearray()
        while True:
            chunk = await resp.content.readany()
            if not chunk:
                msg = f"decode {ep.engine_id} closed the stream before any token"
                raise self._fail("decode", "empty", msg)
            read += chunk
            verdict = scanner.feed(chunk)
            if verdict is not None and verdict.error is not None:
                raise self._error_event(ep, verdict)
            if verdict is not None:
                return bytes(read)

    def _error_event(self, ep: Endpoint, verdict: FirstEvent) -> LegError:
        status = verdict.status
        if status is not None and status < 500:
            # The engine rejected the request itself: recompute cannot help (as with a 4xx status).
            return self._fail("decode", "error_event", verdict.message, status=status, retryable=False)
        # e.g. the KV connector's load failed (kv_load_failure_policy: fail): recompute locally.
        msg = f"decode {ep.engine_id} sent an error before any token: {verdict.message}"
        return self._fail("decode", "error_event", msg)

    def finish_leg(self, leg: OpenLeg) -> None:
        if leg.finished:
            return
        leg.finished = True
        leg.response.close()
        self._end(leg.engine)

    def _drop(self, task: asyncio.Task[OpenLeg]) -> None:
        """A decode task whose leg nobody will relay: close the leg it opened, now or when it ends. A
        cancel can lose the race with the leg opening (asyncio.wait_for then returns the leg instead
        of raising), and an unrelayed leg would hold its slot and decode for nobody."""

        def done(t: asyncio.Task[OpenLeg]) -> None:
            if not t.cancelled() and t.exception() is None:
                self.finish_leg(t.result())

        if task.done():
            done(task)
        else:
            task.add_done_callback(done)

    async def _abort(self, task: asyncio.Task[OpenLeg]) -> None:
        """Cancel a decode leg and wait until its connection is closed (vLLM then aborts the request)."""
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self._drop(task)

    # -- flows ------------------------------------------------------------------------------------

    async def run(
        self, req: legs.ClientRequest, prefill: Endpoint, decode: Endpoint, rid: str,
        decode_only: bool = False, prefill_tokens: int = 0, on_prefill: OnPrefill | None = None,
    ) -> OpenLeg:  # fmt: skip
        """Both legs per mode (or decode alone, which prefills locally); on a retryable failure,
        recompute locally on the other engine. `prefill_tokens`: what P computes (backlog.py).
        `on_prefill` gets P's answer when P's leg ended before D's first token (early.py)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.deadlines.total_s
        self.budget.deposit()
        try:
            if decode_only:
                return await self._decode(req, decode, None, rid, deadline)
            hook = on_prefill or _no_hook
            if self.cfg.mode == "vllm-pull":
                return await self._pull(req, prefill, decode, rid, deadline, prefill_tokens, hook)
            return await self._push(req, prefill, decode, rid, deadline, prefill_tokens, hook)
        except LegError as exc:
            remaining = deadline - loop.time()
            if not exc.retryable or remaining <= 1.0:
                raise exc.as_api_error() from None
            if _costs_capacity(exc) and not self.budget.withdraw():
                raise self._budget_spent(exc) from None
            target = self._target(exc, prefill, decode)
            fallback = decode if target is prefill else prefill
            return await self._recompute(req, target, rid, exc, deadline, fallback)

    def _target(self, exc: LegError, prefill: Endpoint, decode: Endpoint) -> Endpoint:
        """The other engine of the pair, unless it is down while the failed one answered (an error
        event comes from a live engine): when P is down, D's receive fails too, often in the same
        millisecond as P's refused connection, and D is then the one engine left to recompute on."""
        failed, other = (prefill, decode) if exc.leg == "prefill" else (decode, prefill)
        if exc.reason == "error_event" and not self.tracker.is_up(other):
            return failed
        return other

    def _budget_spent(self, cause: LegError) -> ApiError:
        limits = self.cfg.limits
        msg = (
            f"{cause.message}; not recomputed: the recompute budget is exhausted (at most "
            f"{limits.recompute_ratio:g} of recent requests plus {limits.recompute_burst})"
        )
        return ApiError(503, msg, "recompute_budget_exhausted", headers={"Retry-After": RETRY_AFTER_S})

    async def _decode(
        self, req: legs.ClientRequest, ep: Endpoint, params: dict[str, Any] | None, rid: str, deadline: float,
        first_token_bound: bool = True,
    ) -> OpenLeg:  # fmt: skip
        """The decode leg (or a recompute when params is None), streamed whenever it can be, so that
        D's first token is visible and bounded by decode_first_token_s (unless first_token_bound is
        False: push modes bound it from P's finish, in _after_prefill). A coroutine, so that in push
        modes D's body is built only once P's leg, the task started first, is on its way."""
        body = legs.decode_body(req.body, params)
        aggregate = can_aggregate(req.body)
        if aggregate:
            body = streaming_body(body)
        stream = req.stream or aggregate
        remaining = deadline - asyncio.get_running_loop().time()
        bounded = stream and first_token_bound
        timeout = min(self.cfg.deadlines.decode_first_token_s, remaining) if bounded else remaining
        return await self.open_decode(ep, req.path, body, rid, stream, timeout, aggregate)

    async def _push(
        self, req: legs.ClientRequest, p: Endpoint, d: Endpoint, rid: str, deadline: float, tokens: int,
        on_prefill: OnPrefill,
    ) -> OpenLeg:  # fmt: skip
        mode, dl = self.cfg.mode, self.cfg.deadlines
        p_body = legs.prefill_body(req.body, legs.prefill_params(mode, rid, 0, d, dl.transfer_s))
        d_params = legs.decode_params(mode, req.path, rid, 0, p, dl.transfer_s)
        remaining = deadline - asyncio.get_running_loop().time()
        p_leg = self.prefill(p, req.path, p_body, rid, min(dl.prefill_s, remaining), tokens)
        delay = self._decode_delay(p)  # before P's leg starts: the tokens ahead of this request
        p_task = asyncio.create_task(p_leg)

        def d_leg() -> Coroutine[Any, Any, OpenLeg]:
            # D waits for KV while P computes: until P's leg ends only the request's deadline bounds it.
            return self._decode(req, d, d_params, rid, deadline, first_token_bound=False)

        opened = asyncio.Event()  # D's leg sent: from then on D depends on P's KV
        if delay > 0:
            d_task = asyncio.create_task(self._when_due(d_leg, d, p_task, delay, opened))
        else:
            opened.set()
            d_task = asyncio.create_task(d_leg())
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if not d_task.done():
                streams = req.stream or can_aggregate(req.body)
                await self._after_prefill(p_task, d_task, (p, d), deadline, streams, on_prefill)
            return await d_task
        except BaseException:
            self._drop(d_task)  # D's leg may have opened as this handler was cancelled (the client left)
            raise
        finally:
            if not d_task.done():
                d_task.cancel()  # only when this handler itself is cancelled: never leave D running
                self._drop(d_task)
                if not opened.is_set():
                    p_task.cancel()  # no D registered for its KV: free P now, not after its lease
            elif not d_task.cancelled() and d_task.exception() is not None and not p_task.done():
                # D failed (down, or its receive failed): nobody will take P's KV. Closing P's leg
                # aborts its prefill, so P frees the blocks now instead of holding them for its lease.
                p_task.cancel()
            self._detach(p_task)

    def _decode_delay(self, p: Endpoint) -> float:
        """push.decode_start before-prefill: seconds until P is estimated to start this request, less
        decode_lead_s (0 when P is idle or unmeasured: D opens at once, as with-prefill)."""
        push = self.cfg.push
        if push.decode_start != "before-prefill":
            return 0.0
        ahead = self.backlog.wait_s(p.url, 0) or 0.0
        return max(0.0, ahead - push.decode_lead_s)

    async def _when_due(
        self, d_leg: Callable[[], Awaitable[OpenLeg]], d: Endpoint, p_task: asyncio.Task[Any], delay_s: float,
        opened: asyncio.Event,
    ) -> OpenLeg:  # fmt: skip
        """Open D's leg after delay_s or as soon as P's leg ends (its KV is then ready and held for
        D), whichever is first. D counts as busy for selection meanwhile: it is this request's."""
        self.tracker.begin(d)
        t0 = asyncio.get_running_loop().time()
        try:
            await asyncio.wait({p_task}, timeout=delay_s)
        finally:
            self.tracker.end(d)
            self.metrics.decode_delay.observe(asyncio.get_running_loop().time() - t0)
        opened.set()
        return await d_leg()

    async def _after_prefill(
        self, p_task: asyncio.Task[Any], d_task: asyncio.Task[OpenLeg], pair: tuple[Endpoint, Endpoint],
        deadline: float, streams: bool, on_prefill: OnPrefill,
    ) -> None:  # fmt: skip
        """P's leg ended before D's first token. If P failed, D would wait for KV that never comes:
        abort D and raise P's failure (recompute on D). Else D's clock starts now: decode_first_token_s,
        and never less than transfer_s + KV_MARGIN_S. Upstream push can lose a registration and then
        leaves D waiting forever without any error; this bound turns that into a recompute. A
        non-streaming D shows nothing before its whole answer: only the request's deadline bounds it."""
        exc = p_task.exception()
        if exc is not None:
            await self._abort(d_task)
            raise exc
        await on_prefill(p_task.result())
        dl, (p, d) = self.cfg.deadlines, pair
        remaining = deadline - asyncio.get_running_loop().time()
        first_token = max(dl.decode_first_token_s, dl.transfer_s + KV_MARGIN_S)
        bound = min(first_token, remaining) if streams else remaining
        done, _ = await asyncio.wait({d_task}, timeout=bound)
        if done:
            return
        await self._abort(d_task)
        self.tracker.mark_down(d)
        what = "first token" if streams else "answer"
        msg = f"decode {d.engine_id} gave no {what} within {bound:.1f}s after prefill {p.engine_id} finished"
        raise self._fail("decode", "timeout", msg, status=504)

    async def _pull(
        self, req: legs.ClientRequest, p: Endpoint, d: Endpoint, rid: str, deadline: float, tokens: int,
        on_prefill: OnPrefill,
    ) -> OpenLeg:  # fmt: skip
        dl = self.cfg.deadlines
        p_body = legs.prefill_body(req.body, legs.prefill_params("vllm-pull", rid, 0, d, dl.transfer_s))
        remaining = deadline - asyncio.get_running_loop().time()
        answer = await self.prefill(p, req.path, p_body, rid, min(dl.prefill_s, remaining), tokens)
        kv = answer.get("kv_transfer_params")
        if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
            hint = "is it a NixlConnector kv_producer?"
            msg = f"prefill {p.engine_id} returned no usable kv_transfer_params ({kv!r}); {hint}"
            raise self._fail("prefill", "no_kv_params", msg)
        params = legs.decode_params("vllm-pull", req.path, rid, 0, p, 0, kv)
        await on_prefill(answer)
        return await self._decode(req, d, params, rid, deadline)

    async def recompute(
        self, req: legs.ClientRequest, target: Endpoint, rid: str, cause: LegError, remaining_s: float
    ) -> OpenLeg:
        """A leg failed after `run` returned but before anything reached the client (an aggregated
        answer whose stream broke): recompute on `target` like `run` would, or raise the ApiError."""
        self.metrics.leg_errors.labels(cause.leg, cause.reason).inc()
        if remaining_s <= 1.0:
            raise cause.as_api_error()
        if _costs_capacity(cause) and not self.budget.withdraw():
            raise self._budget_spent(cause)
        deadline = asyncio.get_running_loop().time() + remaining_s
        return await self._recompute(req, target, rid, cause, deadline)

    async def _recompute(
        self,
        req: legs.ClientRequest,
        target: Endpoint,
        rid: str,
        cause: LegError,
        deadline: float,
        fallback: Endpoint | None = None,
    ) -> OpenLeg:
        """Recompute on `target`; if it cannot be reached at all (its process died since the pair was
        chosen), on `fallback`, the pair's other engine, once: it failed this request's leg, but may
        well serve a plain one (an engine stuck waiting for KV from a dead peer still runs)."""
        reason = f"{cause.leg}_{cause.reason}"
        log.warning("request %s: recomputing on %s after %s", rid, target.engine_id, reason)
        self.metrics.recomputes.labels(reason).inc()
        try:
            leg = await self._decode(req, target, None, f"{rid}-r1", deadline)
        except LegError as exc:
            msg = f"{cause.message}; recompute on {target.engine_id} failed too: {exc.message}"
            left = deadline - asyncio.get_running_loop().time()
            if exc.reason != "unreachable" or fallback is None or fallback is target or left <= 1.0:
                raise ApiError(exc.status, msg, code=f"{cause.leg}_{cause.reason}") from None
            return await self._recompute(
                req, fallback, f"{rid}-r1", LegError(exc.leg, exc.reason, msg), deadline
            )
        leg.recomputed = reason
        return leg

    def _detach(self, task: asyncio.Task[Any]) -> None:
        """Let a prefill leg finish on its own (bounded by its own timeout); never cancel it."""
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: failures were already counted and logged
            return
        self.detached.add(task)
        self.metrics.background_prefills.set(len(self.detached))

        def _done(t: asyncio.Task[Any]) -> None:
            self.detached.discard(t)
            self.metrics.background_prefills.set(len(self.detached))
            if not t.cancelled():
                t.exception()

        task.add_done_callback(_done)


def status_reason(status: int) -> str:
    """A leg-error reason (a metric label) for an engine's HTTP status: the engine picks the status,
    so only the usual ones get their own label, the rest their class."""
    return f"status_{status}" if status in _LABELLED_STATUSES else f"status_{status // 100}xx"


_LABELLED_STATUSES = frozenset((400, 401, 403, 404, 408, 413, 422, 429, 500, 502, 503, 504))


def _costs_capacity(exc: LegError) -> bool:
    """Whether recomputing after `exc` adds load the budget must cap. Timeouts and 5xx answers are
    what an overloaded engine produces: recomputing them all would double the pool's work when it is
    short. An engine that is down (unreachable, stream cut) or a transfer that failed does no work
    for the request, so its recompute elsewhere costs nothing extra and is never refused."""
    return exc.reason == "timeout" or exc.reason.startswith("status_")


async def _no_hook(answer: dict[str, Any]) -> None:
    return None


def new_request_id() -> str:
    return uuid.uuid4().hex
