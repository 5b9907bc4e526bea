"""The router's state: what one app holds between requests, typed.

`build_state` makes everything that needs no event loop when the app is built (app.py); `Serving` is
what exists only while the app runs (the HTTP session and what uses it), made on start-up inside the
loop. Handlers find the state under `app.STATE` and take it, or the parts they use, explicitly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from kvferry.router.backlog import PrefillBacklog
from kvferry.router.config import RouterConfig
from kvferry.router.discovery import Discovery, make_discovery
from kvferry.router.dispatch import Dispatcher
from kvferry.router.kvfeed import KvEventFeed
from kvferry.router.metrics import RouterMetrics
from kvferry.router.poolstatus import PoolMetrics
from kvferry.router.prefix import PrefixIndex
from kvferry.router.routing import Planner
from kvferry.router.selection import LoadTracker, Selector


@dataclass
class Serving:
    """Made on start-up, inside the event loop; closed on cleanup."""

    session: aiohttp.ClientSession
    dispatcher: Dispatcher
    feed: KvEventFeed | None  # engines' KV-cache events into the prefix index (prefix-aware routing)
    scraper: asyncio.Task[None]  # decode engines' load, every app.SCRAPE_INTERVAL_S


@dataclass
class RouterState:
    config: RouterConfig
    metrics: RouterMetrics
    tracker: LoadTracker
    selector: Selector
    backlog: PrefillBacklog
    planner: Planner
    discovery: Discovery
    index: PrefixIndex | None  # None: prefix-aware routing off
    pool_metrics: PoolMetrics
    _serving: Serving | None = field(default=None, repr=False)

    @property
    def serving(self) -> Serving:
        if self._serving is None:
            raise RuntimeError("the router app has not started")
        return self._serving

    def start(self, serving: Serving) -> None:
        self._serving = serving


def build_state(cfg: RouterConfig) -> RouterState:
    tracker, metrics, routing = LoadTracker(), RouterMetrics(), cfg.routing
    index = PrefixIndex(routing.index_blocks_per_engine) if routing.prefix_aware else None
    selector = Selector(cfg.policy, tracker, cfg.limits.max_in_flight_per_engine, index, routing.load_bound)
    backlog = PrefillBacklog()
    max_wait = cfg.limits.max_prefill_wait_s or cfg.deadlines.prefill_s
    return RouterState(
        config=cfg,
        metrics=metrics,
        tracker=tracker,
        selector=selector,
        backlog=backlog,
        planner=Planner(routing, selector, index, metrics, backlog, max_wait),
        discovery=make_discovery(cfg.static, cfg.kubernetes),
        index=index,
        pool_metrics=PoolMetrics(),
    )
