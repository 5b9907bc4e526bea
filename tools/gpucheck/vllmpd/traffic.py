"""The requests, sent: the reference outputs of the single server and P/D pairs carrying the contract's
kvferry params, one after the other or all at once. Prompts, bodies, legs and the comparison are the
P/D client's (kvferry.tools.pdclient), shared with the e2e tier."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, TypedDict

from kvferry.tools.pdclient import Body, pd_legs, prompt_body, top2_gaps

from .command import GpuServerSpec
from .launch import GpuServer

if TYPE_CHECKING:  # httpx is imported where a request is sent: the SKIP path never loads it
    import httpx


class RequestError(RuntimeError):
    pass


class Reference(TypedDict):
    """The single server's greedy output for one prompt and its top-2 logprob gaps."""

    token_ids: list[int]
    gaps: list[float]


References = dict[str, Reference]
Answer = Body | BaseException  # a pair's decode choice, or what ended the pair


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


async def _post(
    client: httpx.AsyncClient, url: str, body: Body, headers: dict[str, str] | None = None
) -> Body:
    resp = await client.post(url + "/v1/completions", json=body, headers=headers)
    if resp.status_code != 200:
        raise RequestError(f"{url}: HTTP {resp.status_code} {resp.text[:300]}")
    choice: Body = resp.json()["choices"][0]
    return choice


async def reference_outputs(
    url: str, prompts: dict[str, list[int]], max_tokens: int, timeout_s: float
) -> References:
    import httpx

    out: References = {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for key, prompt in prompts.items():
            choice = await _post(client, url, prompt_body(prompt, max_tokens, logprobs=2))
            out[key] = {"token_ids": choice.get("token_ids") or [], "gaps": top2_gaps(choice)}
    return out


async def pd_pair(client: httpx.AsyncClient, p: GpuServer, d: GpuServer, body: Body) -> Body:
    rid = uuid.uuid4().hex
    prefill, decode = spec_legs(body, rid, producer=p.gspec, consumer=d.gspec)
    headers = {"X-Request-Id": rid}
    _, choice = await asyncio.gather(
        _post(client, p.url, prefill, headers), _post(client, d.url, decode, headers)
    )
    return choice


async def pd_sequence(
    p: GpuServer, d: GpuServer, bodies: dict[str, Body], timeout_s: float
) -> dict[str, Answer]:
    """Pairs one after the other; a failed pair is recorded, not raised."""
    import httpx

    out: dict[str, Answer] = {}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for key, body in bodies.items():
            try:
                out[key] = await pd_pair(client, p, d, body)
            except Exception as exc:
                out[key] = exc
    return out


async def pd_burst(
    p: GpuServer, d: GpuServer, bodies: list[Body], timeout_s: float
) -> tuple[float, list[Answer]]:
    """All pairs at once; (wall seconds, results or exceptions)."""
    import httpx

    limits = httpx.Limits(max_connections=4 * len(bodies) + 8)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(pd_pair(client, p, d, b) for b in bodies), return_exceptions=True)
        return time.perf_counter() - t0, list(results)
