"""Test client for the P/D e2e suite: fixed greedy prompts and helpers that collect generated tokens."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

MAX_TOKENS = 16
# Prompt lengths in tokens around the CPU block size (128) and its multiples, plus odd sizes.
PROMPT_LENGTHS = (5, 127, 128, 129, 300, 700, 1500)
CHAT_PROMPTS = ("hello ferry, carry the cache across", "the river is wide " * 20)


def token_prompt(length: int) -> list[int]:
    """A deterministic token-id prompt of exactly `length` tokens (ids above the special tokens)."""
    return [10 + (i * 7919 + length) % 2000 for i in range(length)]


def completion_body(length: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny", "prompt": token_prompt(length), "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": stream, "return_token_ids": True,
    }  # fmt: skip


def chat_body(text: str) -> dict[str, Any]:
    return {
        "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip


async def complete(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(url, json=body)
    assert resp.status_code == 200, f"{url}: {resp.status_code} {resp.text[:500]}"
    return resp.json()


async def stream_text(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str:
    """Concatenated text of an SSE completion stream; fails on an error event."""
    text = []
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, f"{url}: {resp.status_code} {(await resp.aread())[:500]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.extend(c.get("text", "") for c in event.get("choices", []))
    return "".join(text)


async def _one(client: httpx.AsyncClient, sem: asyncio.Semaphore, url: str, key: str, body: dict) -> tuple:
    async with sem:
        if body.get("stream"):
            return key, {"text": await stream_text(client, url, body)}
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
