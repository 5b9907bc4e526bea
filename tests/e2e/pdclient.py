"""Test client for the P/D e2e suite: the fixed greedy requests and helpers that send them and collect
the generated tokens, asserting every answer. Bodies, legs and the comparison are the package's
(kvferry.tools.pdclient), shared with the vLLM GPU check."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from kvferry.tools.pdclient import chat_body, completion_body, top2_gaps, with_logprobs

# Prompt lengths in tokens around the CPU block size (128) and its multiples, plus odd sizes.
PROMPT_LENGTHS = (5, 127, 128, 129, 300, 700, 1500)
CHAT_PROMPTS = ("hello ferry, carry the cache across", "the river is wide " * 20)


async def complete(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(url, json=body)
    assert resp.status_code == 200, f"{url}: {resp.status_code} {resp.text[:500]}"
    return resp.json()


async def stream_answer(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Concatenated text and token ids of an SSE completion stream; fails on an error event."""
    text: list[str] = []
    ids: list[int] = []
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, f"{url}: {resp.status_code} {(await resp.aread())[:500]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                text.append(choice.get("text", ""))
                ids.extend(choice.get("token_ids") or [])
    return {"text": "".join(text), "token_ids": ids}


async def _one(client: httpx.AsyncClient, sem: asyncio.Semaphore, url: str, key: str, body: dict) -> tuple:
    async with sem:
        if body.get("stream"):
            return key, await stream_answer(client, url, body)
        choice = (await complete(client, url, body))["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return key, {"token_ids": choice.get("token_ids"), "text": text}


def requests() -> list[tuple[str, str, dict[str, Any]]]:
    """(key, path, body) for every fixed request: token prompts, chat, and two streamed prompts."""
    reqs = [(f"len{n}", "/v1/completions", completion_body(n)) for n in PROMPT_LENGTHS]
    reqs += [(f"chat{i}", "/v1/chat/completions", chat_body(t)) for i, t in enumerate(CHAT_PROMPTS)]
    reqs += [(f"stream{n}", "/v1/completions", completion_body(n, stream=True)) for n in (129, 700)]
    return reqs


def outputs(base_url: str, concurrency: int = 4, timeout_s: float = 120.0) -> dict[str, Any]:
    """Greedy outputs for every fixed request, sent `concurrency` at a time: token ids and texts."""

    async def run() -> dict[str, Any]:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            jobs = [_one(client, sem, base_url + path, key, body) for key, path, body in requests()]
            return dict(await asyncio.gather(*jobs))

    return asyncio.run(run())


def reference_gaps(base_url: str, timeout_s: float = 120.0) -> dict[str, list[float]]:
    """Top-2 logprob gaps of the reference's greedy tokens, for every fixed request."""
    gaps = {}
    with httpx.Client(timeout=timeout_s) as client:
        for key, path, body in requests():
            resp = client.post(base_url + path, json=with_logprobs(path, body))
            assert resp.status_code == 200, f"{key}: {resp.status_code} {resp.text[:300]}"
            gaps[key] = top2_gaps(resp.json()["choices"][0])
    return gaps
