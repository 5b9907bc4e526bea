"""The requests, sent: the reference outputs of the single server and P/D pairs carrying the contract's
kvferry params, one after the other or all at once. Prompts, bodies, legs and the comparison are the
P/D client's (kvferry.tools.pdclient), shared with the e2e tier."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from kvferry.tools.pdclient import Body, pd_legs, prompt_body, top2_gaps

from .command import GpuServerSpec
from .launch import GpuServer


class RequestError(RuntimeError):
    pass


def spec_legs(body: Body, rid: str, *, producer: GpuServerSpec, consumer: GpuServerSpec) -> tuple[Body, Body]:
    """(prefill leg, decode leg) of request `rid` from P's and D's server specs."""
    if producer.engine_id is None or producer.side_port is None or consumer.engine_id is None:
        raise ValueError("a P/D pair needs P's engine id and side port and D's engine id")
    return pd_legs(
        body,
        rid,
        prefill_engine=producer.engine_id,
        prefill_side_port=producer.side_port,
        decode_engine=consumer.engine_id,
    )


async def _post(client: Any, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict:
    resp = await client.post(url + "/v1/completions", json=body, headers=headers)
    if resp.status_code != 200:
        raise RequestError(f"{url}: HTTP {resp.status_code} {resp.text[:300]}")
    return resp.json()["choices"][0]


async def reference_outputs(
    url: str, prompts: dict[str, list[int]], max_tokens: int, timeout_s: float
) -> dict:
    import httpx

    out = {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for key, prompt in prompts.items():
            choice = await _post(client, url, prompt_body(prompt, max_tokens, logprobs=2))
            out[key] = {"token_ids": choice.get("token_ids") or [], "gaps": top2_gaps(choice)}
    return out


async def pd_pair(client: Any, p: GpuServer, d: GpuServer, body: dict[str, Any]) -> dict:
    rid = uuid.uuid4().hex
    prefill, decode = spec_legs(body, rid, producer=p.gspec, consumer=d.gspec)
    headers = {"X-Request-Id": rid}
    _, choice = await asyncio.gather(
        _post(client, p.url, prefill, headers), _post(client, d.url, decode, headers)
    )
    return choice


async def pd_sequence(p: GpuServer, d: GpuServer, bodies: dict[str, dict], timeout_s: float) -> dict:
    """Pairs one after the other; a failed pair is recorded, not raised."""
    import httpx

    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for key, body in bodies.items():
            try:
                out[key] = await pd_pair(client, p, d, body)
            except Exception as exc:
                out[key] = exc
    return out


async def pd_burst(p: GpuServer, d: GpuServer, bodies: list[dict], timeout_s: float) -> tuple[float, list]:
    """All pairs at once; (wall seconds, results or exceptions)."""
    import httpx

    limits = httpx.Limits(max_connections=4 * len(bodies) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(pd_pair(client, p, d, b) for b in bodies), return_exceptions=True)
        return time.perf_counter() - t0, list(results)
