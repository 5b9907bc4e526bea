"""Pool status step: the transfer metrics of this router's engines, gathered into one answer.

The operator used to read every engine pod's /metrics to write each CR's transfer status, so its
work grew with pods. The router already knows its pool (discovery) and talks to every engine; on a
GET of contracts.pods.POOL_METRICS_PATH it reads each engine's /metrics at once (bounded in time and
size), keeps only the families transfer status is computed from (the connector's `kvferry_*`, vLLM's
`vllm:nixl_*` and prompt tokens by source) and answers with them by role:

    {"prefill": ["<text of engine 1>", ...], "decode": [...], "unreachable": {"prefill": 0, "decode": 1}}

Each engine's text stays separate, so the operator's pure summary (operator/status/transfer.py) reads
them exactly as it reads pods it fetched itself, and counts scraped pods the same way.

The route is unauthenticated (like /metrics), so what a caller can make the router do is bounded: an
answer is reused for CACHE_TTL_S, concurrent callers share one scrape (single flight), and each
engine's body is read to at most MAX_ENGINE_BYTES.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from kvferry.router import bounded
from kvferry.router.config import Endpoint

# Families transfer status reads: the connector's, and vLLM's own NIXL connector's and token sources.
KEPT_PREFIXES = ("kvferry_", "vllm:nixl_", "vllm:prompt_tokens_by_source")
FETCH_TIMEOUT_S = 2.0
MAX_ENGINE_BYTES = 4 << 20  # vLLM's /metrics is tens of KiB; a body past this is not metrics
CACHE_TTL_S = 2.0  # the operator reads each CR's pool every few seconds at most


def _family(line: str) -> str:
    """The metric name a line of Prometheus text is about ('' for other comments and blank lines)."""
    if line.startswith("# HELP ") or line.startswith("# TYPE "):
        return line.split(" ", 3)[2] if line.count(" ") >= 2 else ""
    if not line or line.startswith("#"):
        return ""
    return line.split("{", 1)[0].split(" ", 1)[0]


def transfer_families(text: str) -> str:
    """Only the lines of `text` that belong to the families transfer status reads."""
    kept = [line for line in text.splitlines() if _family(line).startswith(KEPT_PREFIXES)]
    return "\n".join(kept) + ("\n" if kept else "")


async def _fetch(session: aiohttp.ClientSession, engine: Endpoint) -> str | None:
    try:
        timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
        async with session.get(engine.url + "/metrics", timeout=timeout, allow_redirects=False) as resp:
            if resp.status != 200:
                return None
            body = await bounded.read_capped(resp, MAX_ENGINE_BYTES, f"{engine.engine_id} /metrics")
            return transfer_families(body.decode("utf-8", errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):  # BoundError: past the cap
        return None  # counted as unreachable; the operator reports fewer scraped pods


async def gather(
    session: aiohttp.ClientSession, prefill: tuple[Endpoint, ...], decode: tuple[Endpoint, ...]
) -> dict[str, Any]:
    """Every engine's transfer metrics by role, read concurrently."""
    texts = await asyncio.gather(*(_fetch(session, e) for e in (*prefill, *decode)))
    by_role = {"prefill": list(texts[: len(prefill)]), "decode": list(texts[len(prefill) :])}
    return {
        **{role: [t for t in got if t is not None] for role, got in by_role.items()},
        "unreachable": {role: sum(t is None for t in got) for role, got in by_role.items()},
    }


Pool = tuple[tuple[Endpoint, ...], tuple[Endpoint, ...]]


class PoolMetrics:
    """gather() behind a short cache and a single flight: however many callers, at most one scrape of
    the pool runs at a time, and its answer serves every caller for CACHE_TTL_S."""

    def __init__(self, ttl_s: float = CACHE_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._answer: tuple[Pool, float, dict[str, Any]] | None = None  # pool, when read, answer
        self._flight: tuple[Pool, asyncio.Task[dict[str, Any]]] | None = None
        self.scrapes = 0

    async def get(self, session: aiohttp.ClientSession, pool: Pool) -> dict[str, Any]:
        if self._answer is not None:
            read_for, at, answer = self._answer
            if read_for == pool and self.clock() - at < self.ttl_s:
                return answer
        if self._flight is None or self._flight[0] != pool or self._flight[1].done():
            self.scrapes += 1
            task = asyncio.create_task(self._scrape(session, pool))
            self._flight = (pool, task)
        # shield: a caller that leaves (its handler cancelled) must not cancel the others' scrape
        return await asyncio.shield(self._flight[1])

    async def _scrape(self, session: aiohttp.ClientSession, pool: Pool) -> dict[str, Any]:
        answer = await gather(session, *pool)
        self._answer = (pool, self.clock(), answer)
        return answer
