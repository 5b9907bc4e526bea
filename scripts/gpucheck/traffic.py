"""The requests: deterministic token prompts, the reference outputs of the single server, P/D pairs
carrying the contract's kvferry params (one after the other, or all at once), and output comparison."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

from kvferry.contracts.params import ConsumerParams, ProducerParams

from .command import DEADLINE_S, HOST, SERVED_NAME, GpuServerSpec
from .launch import GpuServer


class RequestError(RuntimeError):
    pass


def token_prompt(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of exactly `length` token ids above the special tokens."""
    return [10 + (i * 7919 + length + salt * 104729) % 2000 for i in range(length)]


def completion_body(prompt: list[int], max_tokens: int, logprobs: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        "return_token_ids": True,
    }
    if logprobs:
        body["logprobs"] = logprobs
    return body


def pd_legs(
    body: dict[str, Any], rid: str, *, producer: GpuServerSpec, consumer: GpuServerSpec, attempt: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill leg, decode leg) carrying the contract's kvferry params (kvferry.contracts.params)."""
    p = ProducerParams(rid, attempt, consumer.engine_id, DEADLINE_S)
    d = ConsumerParams(rid, attempt, producer.engine_id, HOST, producer.side_port, 1, DEADLINE_S)
    prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": p.kv_transfer_params()}
    decode = {**body, "kv_transfer_params": d.kv_transfer_params()}
    return prefill, decode


def top2_gaps(choice: Mapping[str, Any]) -> list[float]:
    """Per generated position of a completions choice: best minus second-best logprob."""
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    out = []
    for t in tops:
        values = sorted((t or {}).values(), reverse=True)
        out.append(values[0] - values[1] if len(values) > 1 else math.inf)
    return out


def compare(want: list[int], got: list[int] | None, gaps: list[float], tie: float = 0.0) -> tuple[str, str]:
    """('equal' | 'tie' | 'differs', detail). 'tie': the outputs part where the reference's top-2
    logprobs are within `tie` (0 = strict: any difference differs)."""
    if got == want:
        return "equal", ""
    got = got or []
    at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
    if at is None:
        return "differs", f"{len(got)} tokens, reference {len(want)}"
    gap = gaps[at] if at < len(gaps) else math.inf
    detail = f"token {at} is {got[at]}, reference {want[at]} (reference top-2 gap {gap:.1e})"
    return ("tie" if tie > 0 and gap <= tie else "differs"), detail


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
            choice = await _post(client, url, completion_body(prompt, max_tokens, logprobs=2))
            out[key] = {"token_ids": choice.get("token_ids") or [], "gaps": top2_gaps(choice)}
    return out


async def pd_pair(client: Any, p: GpuServer, d: GpuServer, body: dict[str, Any]) -> dict:
    rid = uuid.uuid4().hex
    prefill, decode = pd_legs(body, rid, producer=p.gspec, consumer=d.gspec)
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
