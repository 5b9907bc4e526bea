"""Router HTTP step: the OpenAI-compatible aiohttp app (/v1/completions, /v1/chat/completions,
/v1/models, /health, /livez, /metrics) that validates requests, picks engines and relays decode's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from kvferry.contracts.pods import POOL_METRICS_PATH
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.router import bounded, early, poolstatus
from kvferry.router import params as legs
from kvferry.router.aggregate import Aggregator, AnswerTooLarge
from kvferry.router.config import RouterConfig
from kvferry.router.dispatch import Dispatcher, OpenLeg, new_request_id
from kvferry.router.errors import RETRY_AFTER_S, ApiError, LegError, error_body
from kvferry.router.framing import EventFramer
from kvferry.router.kvfeed import KvEventFeed
from kvferry.router.routing import Plan
from kvferry.router.selection import NoBackendError, OverloadedError
from kvferry.router.state import RouterState, Serving, build_state

log = logging.getLogger(__name__)
SCRAPE_INTERVAL_S = 2.0
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_MODELS_BYTES = 1 << 20  # decode's /v1/models, relayed when the config names no model
# The pool's transfer metrics are metrics too: readable like /metrics (the operator holds no API key).
UNAUTHENTICATED_PATHS = ("/health", "/livez", "/metrics", POOL_METRICS_PATH)
# Requests shed on purpose get their own outcome label (kvferry_router_requests_total), not "error".
SHED_OUTCOMES = ("overloaded", "recompute_budget_exhausted")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# How the app must be served (web.run_app, web.AppRunner): a client that disconnects cancels its
# handler, so every kind of request (streamed, aggregated, plain) closes its legs, which makes vLLM
# abort them, and frees its in-flight slots. Without it aiohttp lets a handler run on, and an
# aggregated request decodes to max_tokens for nobody.
SERVE_OPTIONS: dict[str, Any] = {"handler_cancellation": True, "shutdown_timeout": 15.0}

STATE = web.AppKey("state", RouterState)


def _json_error(status: int, message: str, code: str | None = None, param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, code, param), status=status)


def _auth_middleware(api_key: str | None) -> Any:
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        state = request.app[STATE]
        try:
            if expected is not None and request.path not in UNAUTHENTICATED_PATHS:
                given = request.headers.get("Authorization", "").encode()
                # Constant-time compare: response timing must not reveal how much of the key matched.
                if not hmac.compare_digest(given, expected):
                    raise ApiError(
                        401, "missing or wrong API key (Authorization: Bearer ...)", "invalid_api_key"
                    )
            return await handler(request)
        except ApiError as exc:
            state.metrics.errors_by_status.labels(str(exc.status)).inc()
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _json_error(exc.status, exc.reason or "error", code=exc.reason.lower().replace(" ", "_"))

    return middleware


async def _read_json(request: web.Request) -> Any:
    """The body as JSON, bounded in bytes (client_max_size: 413), nesting and integer size (400)."""
    try:
        return bounded.loads(await request.read(), "request body")
    except bounded.BoundError as exc:
        raise ApiError(400, str(exc), "invalid_json") from None


class _Early:
    """streaming.first_token prefill for one request (early.py): starts the client's stream with
    prefill's token when prefill's leg returns first, and says how decode's stream must be rewritten."""

    def __init__(self, request: web.Request, rid: str, want_ids: bool, started: float) -> None:
        self.request, self.rid, self.want_ids, self.started = request, rid, want_ids, started
        self.chat = request.path == legs.CHAT
        self.response: web.StreamResponse | None = None
        self.first: early.FirstToken | None = None

    async def on_prefill(self, answer: dict[str, Any]) -> None:
        first = early.first_token(answer, self.chat, self.want_ids)
        if first is None:
            return  # not mirrorable: the client's stream starts with decode's token, as without this
        state = self.request.app[STATE]
        resp = web.StreamResponse(status=200, headers={"X-Request-Id": self.rid, **_SSE})
        await resp.prepare(self.request)
        await resp.write(first.event)
        self.response, self.first = resp, first
        state.metrics.ttft.labels(state.config.mode).observe(time.monotonic() - self.started)
        state.metrics.first_token_from_prefill.inc()

    def echo(self) -> early.DecodeEcho:
        return early.DecodeEcho(self.first, self.chat, self.want_ids)


_SSE = {"Content-Type": "text/event-stream"}


async def _generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    cfg, metrics, dispatcher = state.config, state.metrics, state.serving.dispatcher
    req = legs.validate(request.path, await _read_json(request), cfg.model)
    started = time.monotonic()
    rid = new_request_id()
    outcome, first = "error", None
    try:
        plan = _plan(state, req)
        prefill, decode = plan.choice.prefill, plan.choice.decode
        if (
            cfg.streaming.first_token == "prefill"
            and not plan.decode_only
            and early.eligible(req.body, req.stream)
        ):
            first = _Early(request, rid, bool(req.body.get("return_token_ids")), started)
            req = replace(req, body={**req.body, "return_token_ids": True})  # both legs: the check needs ids
        hook = first.on_prefill if first else None
        leg = await dispatcher.run(
            req, prefill, decode, rid, decode_only=plan.decode_only, prefill_tokens=plan.prefill_tokens,
            on_prefill=hook,
        )  # fmt: skip
        try:
            response, outcome = await _relay(request, leg, rid, state, started, first)
        except LegError as exc:  # an aggregated answer broke before anything reached the client
            other = prefill if leg.engine is decode else decode
            remaining = started + cfg.deadlines.total_s - time.monotonic()
            leg = await dispatcher.recompute(req, other, rid, exc, remaining)
            response, outcome = await _relay(request, leg, rid, state, started, first)
        return response
    except asyncio.CancelledError:
        outcome = "client_disconnect"  # the client left (SERVE_OPTIONS): the legs are closed on the way out
        raise
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        if first is None or first.response is None:
            raise
        outcome = "client_disconnect"  # while prefill's token was being sent
        return first.response
    except ApiError as exc:
        outcome = exc.code if exc.code in SHED_OUTCOMES else "error"
        if first is None or first.response is None:
            raise
        # The client's stream has started (prefill's token): the only honest report is an error event.
        metrics.errors_by_status.labels(str(exc.status)).inc()
        await _error_event(first.response, exc.body())
        return first.response
    finally:
        metrics.requests.labels(request.path, cfg.mode, outcome).inc()
        metrics.duration.labels(request.path, cfg.mode).observe(time.monotonic() - started)


def _plan(state: RouterState, req: legs.ClientRequest) -> Plan:
    try:
        return state.planner.plan(state.discovery.current(), req)
    except NoBackendError as exc:
        raise ApiError(503, str(exc), "no_backend") from None
    except OverloadedError as exc:
        state.metrics.shed.labels(exc.role, exc.limit).inc()
        raise ApiError(429, str(exc), "overloaded", headers={"Retry-After": RETRY_AFTER_S}) from None


async def _relay(
    request: web.Request, leg: OpenLeg, rid: str, state: RouterState, started: float,
    first: _Early | None = None,
) -> tuple[web.StreamResponse, str]:  # fmt: skip
    """Send decode's answer to the client (after prefill's token, when `first` started the stream);
    returns the response and the outcome label."""
    cfg, metrics, dispatcher = state.config, state.metrics, state.serving.dispatcher
    headers = {"X-Request-Id": rid}
    if leg.recomputed:
        headers["X-Kvferry-Recomputed"] = leg.recomputed
    outcome = "recomputed" if leg.recomputed else "ok"
    try:
        if leg.aggregate:
            metrics.ttft.labels(cfg.mode).observe(time.monotonic() - started)
            answer = await _aggregate(leg, request.path == legs.CHAT, started + cfg.deadlines.total_s)
            return web.json_response(answer, headers=headers), outcome
        if not leg.stream:
            metrics.ttft.labels(cfg.mode).observe(time.monotonic() - started)
            body = web.Response(body=leg.first, status=200, content_type="application/json", headers=headers)
            return body, outcome
        started_early = first.response if first else None  # prefill's token already sent on it
        resp = started_early if started_early is not None else web.StreamResponse(headers={**headers, **_SSE})
        # Early first token: check and strip what the router asked for; else relay whole events only.
        echo: early.DecodeEcho | EventFramer = first.echo() if first else EventFramer()
        try:
            if started_early is None:
                await resp.prepare(request)
            await resp.write(echo.feed(leg.first))
            if started_early is None:
                metrics.ttft.labels(cfg.mode).observe(time.monotonic() - started)
            remaining = started + cfg.deadlines.total_s - time.monotonic()
            await asyncio.wait_for(_pipe(leg, resp, echo), max(remaining, 0.1))
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            return resp, "client_disconnect"  # closing D's response below makes vLLM abort the request
        except early.Mismatch as exc:
            metrics.leg_errors.labels("decode", "first_token_mismatch").inc()
            log.error("request %s: %s", rid, exc)
            await _error_event(resp, error_body(502, str(exc), "first_token_mismatch"))
            return resp, "error"
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # Headers are out: the only honest report left is an error event in the stream.
            msg = f"decode {leg.engine.engine_id} stream broke: {exc!r}"
            await _error_event(resp, error_body(502, msg, "decode_stream"))
            return resp, "error"
        return resp, outcome
    finally:
        dispatcher.finish_leg(leg)


async def _aggregate(leg: OpenLeg, chat: bool, deadline: float) -> dict[str, Any]:
    """Collect decode's stream into one answer, within the request's total deadline."""
    agg = Aggregator(chat)
    agg.feed(leg.first)

    async def drain() -> None:
        async for chunk in leg.response.content.iter_any():
            agg.feed(chunk)
            if agg.error is not None:
                return  # the answer is lost: stop reading (closing the leg aborts it)

    try:
        await asyncio.wait_for(drain(), max(deadline - time.monotonic(), 0.1))
    except AnswerTooLarge as exc:
        raise ApiError(502, f"decode {leg.engine.engine_id}: {exc}", "decode_too_large") from None
    except asyncio.TimeoutError:
        raise ApiError(504, f"decode {leg.engine.engine_id} did not finish within the total deadline",
                       "decode_timeout") from None  # fmt: skip
    except aiohttp.ClientError as exc:
        broke = f"decode {leg.engine.engine_id} stream broke: {exc!r}"
        if leg.recomputed:
            raise ApiError(502, broke, "decode_stream") from None
        raise LegError("decode", "stream", broke) from None  # the client saw nothing: recompute
    if agg.error is not None:
        message = f"decode {leg.engine.engine_id}: {agg.error.get('message', agg.error)}"
        if leg.recomputed:
            raise ApiError(502, message, "decode_error")
        raise LegError("decode", "error_event", message)
    return agg.result()


async def _pipe(leg: OpenLeg, resp: web.StreamResponse, echo: early.DecodeEcho | EventFramer) -> None:
    async for chunk in leg.response.content.iter_any():
        if out := echo.feed(chunk):  # whole events only (framing.py)
            await resp.write(out)
    if rest := echo.flush():
        await resp.write(rest)


async def _error_event(resp: web.StreamResponse, body: dict[str, Any]) -> None:
    with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
        await resp.write(f"data: {json.dumps(body)}\n\n".encode())


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cfg = state.config
    if cfg.model:
        card = {"id": cfg.model, "object": "model", "created": 0, "owned_by": "kvferry"}
        return web.json_response({"object": "list", "data": [card]})
    pool = state.discovery.current()
    if not pool.decode:
        raise ApiError(503, "no decode engine is available to list models", "no_backend")
    try:
        async with state.serving.session.get(
            pool.decode[0].url + "/v1/models", timeout=aiohttp.ClientTimeout(10)
        ) as r:
            what = f"decode {pool.decode[0].engine_id}'s model list"
            listed = bounded.loads(await bounded.read_capped(r, MAX_MODELS_BYTES, what), what)
            return web.json_response(listed, status=r.status if 200 <= r.status < 600 else 502)
    except (aiohttp.ClientError, asyncio.TimeoutError, bounded.BoundError) as exc:
        raise ApiError(
            502, f"decode {pool.decode[0].engine_id} did not list models: {exc!r}", "upstream"
        ) from None


async def _health(request: web.Request) -> web.Response:
    pool = request.app[STATE].discovery.current()
    body = {"prefill": len(pool.prefill), "decode": len(pool.decode), "revisions": sorted(pool.revisions())}
    ok = bool(pool.revisions())
    return web.json_response({"status": "ok" if ok else "no_engine_pair", **body}, status=200 if ok else 503)


async def _livez(request: web.Request) -> web.Response:
    """Liveness: the process answers. Not /health, which is 503 while engines load: a liveness probe
    on it would restart a healthy router for as long as vLLM takes to start."""
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    pool = state.discovery.current()
    state.metrics.engines.labels("prefill").set(len(pool.prefill))
    state.metrics.engines.labels("decode").set(len(pool.decode))
    return web.Response(body=state.metrics.render(), content_type="text/plain")


async def _pool_metrics(request: web.Request) -> web.Response:
    """The current pool's transfer metrics as JSON (poolstatus.py)."""
    state = request.app[STATE]
    pool = state.discovery.current()
    answer = await state.pool_metrics.get(state.serving.session, (pool.prefill, pool.decode))
    return web.json_response(answer)


async def _scrape_loop(state: RouterState, session: aiohttp.ClientSession, feed: KvEventFeed | None) -> None:
    """Keep decode load fresh for least-loaded selection (queue length, KV-cache usage); drop the load
    entries of engines that left the pool."""
    while True:
        pool = state.discovery.current()
        state.tracker.prune(pool)
        state.planner.forget(pool)
        state.metrics.forget_engines({(e.role, e.engine_id) for e in (*pool.prefill, *pool.decode)})
        if feed is not None:
            feed.sync((*pool.prefill, *pool.decode))
        for ep in pool.decode:
            try:
                async with session.get(ep.url + "/metrics", timeout=aiohttp.ClientTimeout(2)) as r:
                    text = await bounded.read_capped(
                        r, poolstatus.MAX_ENGINE_BYTES, f"{ep.engine_id} /metrics"
                    )
                    m = parse_metrics(text.decode("utf-8", errors="replace"))
                state.tracker.observe(
                    ep, metric_sum(m, "vllm:num_requests_waiting"), metric_sum(m, "vllm:kv_cache_usage_perc")
                )
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue  # load unknown this round; in-flight counts still steer selection
        await asyncio.sleep(SCRAPE_INTERVAL_S)


async def _on_startup(app: web.Application) -> None:
    state = app[STATE]
    cfg = state.config
    # vLLM's server (uvicorn) drops idle keep-alive connections after 5 s; reusing one it just closed
    # fails a leg as "unreachable". Expire ours first.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3)
    session = aiohttp.ClientSession(connector=connector)
    dispatcher = Dispatcher(cfg, session, state.tracker, state.metrics, state.backlog)
    await state.discovery.start()
    # With prefix-aware routing, engines that publish vLLM's KV-cache events correct the index.
    index = state.index
    feed = None if index is None else KvEventFeed(index, cfg.routing.block_tokens, state.metrics)
    scraper = asyncio.create_task(_scrape_loop(state, session, feed))
    state.start(Serving(session, dispatcher, feed, scraper))


async def _on_cleanup(app: web.Application) -> None:
    state = app[STATE]
    serving = state.serving
    serving.scraper.cancel()
    detached = list(serving.dispatcher.detached)
    if detached:
        # Prefill legs still running for gone clients: give them a bounded chance to finish.
        await asyncio.wait(detached, timeout=10)
    await asyncio.gather(serving.scraper, return_exceptions=True)
    if serving.feed is not None:
        await serving.feed.stop()
    await state.discovery.stop()
    await serving.session.close()


def build_app(cfg: RouterConfig, api_key: str | None = None) -> web.Application:
    """The router app; api_key None turns authentication off."""
    app = web.Application(middlewares=[_auth_middleware(api_key)], client_max_size=MAX_BODY_BYTES)
    app[STATE] = build_state(cfg)
    app.router.add_post(legs.COMPLETIONS, _generate)
    app.router.add_post(legs.CHAT, _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/livez", _livez)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get(POOL_METRICS_PATH, _pool_metrics)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    return app
