"""Pool status step: the transfer metrics of this router's engines, gathered into one answer.

The operator used to read every engine pod's /metrics to write each CR's transfer status, so its
work grew with pods. The router already knows its pool (discovery) and talks to every engine; on a
GET of contracts.pods.POOL_METRICS_PATH it reads each engine's /metrics at once (bounded in time and
size), keeps only the families transfer status is computed from (the connector's `kvferry_*`, vLLM's
`vllm:nixl_*` and prompt tokens by source) and answers with them by role:

    {"prefill": ["<text of engine 1>", ...], "decode": [...], "unreachable": {"prefill": 0, "decode": 1}}

Each engine's text stays separate, so the operator's pure summary (operator/status/transfer.py) reads
them exactly as it reads pods it fetched itself, and counts scraped pods the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from kvferry.router.config import Endpoint

# Families transfer status reads: the connector's, and vLLM's own NIXL connector's and token sources.
KEPT_PREFIXES = ("kvferry_", "vllm:nixl_", "vllm:prompt_tokens_by_source")
FETCH_TIMEOUT_S = 2.0
MAX_ENGINE_BYTES = 4 << 20  # vLLM's /metrics is tens of KiB; a body past this is not metrics


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
            body = await resp.content.read(MAX_ENGINE_BYTES + 1)
            if len(body) > MAX_ENGINE_BYTES:
                return None
            return transfer_families(body.decode("utf-8", errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
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


def handler(
    state_of: Callable[[web.Request], dict[str, Any]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The GET handler: the current pool's transfer metrics as JSON (`state_of` finds the app's state)."""

    async def pool_metrics(request: web.Request) -> web.Response:
        state = state_of(request)
        pool = state["discovery"].current()
        return web.json_response(await gather(state["session"], pool.prefill, pool.decode))

    return pool_metrics
