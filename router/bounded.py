"""Bounds step: what clients and engines hand the router is bounded before it is used.

Bodies are read with a byte cap (a peer chooses how much it sends; aiohttp's `read()`/`json()` take
all of it, and `content.read(n)` may return less than n, silently truncating), and JSON is parsed
with bounds on nesting and integer size: Python's parser answers a 5,000-digit integer with
ValueError and deep nesting with RecursionError, which the handlers did not expect (a 500 with a
traceback). Everything here raises `BoundError` (a ValueError) with a message naming the limit.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

MAX_JSON_DEPTH = 64  # OpenAI bodies nest a few levels (messages, content parts, tool schemas)
MAX_JSON_INT = 1 << 64  # token ids, seeds and counts all fit in 64 bits


class BoundError(ValueError):
    """Input past a bound, or JSON that does not parse; the message says which."""


async def read_capped(resp: aiohttp.ClientResponse, cap: int, what: str) -> bytes:
    """The whole body, or BoundError once it passes `cap` bytes (read no further than that)."""
    if resp.content_length is not None and resp.content_length > cap:
        raise BoundError(f"{what} sent {resp.content_length} bytes, more than the {cap} allowed")
    chunks, size = [], 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > cap:
            raise BoundError(f"{what} sent more than the {cap} bytes allowed")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_prefix(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most the first `limit` bytes of the body (e.g. for an error message), never more."""
    chunks, size = [], 0
    async for chunk in resp.content.iter_any():
        chunks.append(chunk[: limit - size])
        size += len(chunks[-1])
        if size >= limit:
            break
    return b"".join(chunks)


def loads(data: str | bytes, what: str) -> Any:
    """JSON within MAX_JSON_DEPTH levels and integers below MAX_JSON_INT in size, or BoundError."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise BoundError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise BoundError(f"{what} is not valid JSON: {_short(exc)}") from None
    check(value, what)
    return value


def check(value: Any, what: str) -> None:
    """Raise BoundError if `value` nests deeper than MAX_JSON_DEPTH or holds an integer too large."""
    if type(value) is int and not -MAX_JSON_INT < value < MAX_JSON_INT:
        raise BoundError(f"{what} holds an integer outside +-2**64")
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items: Any = node.values()
        elif isinstance(node, list):
            items = node
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise BoundError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
        for item in items:
            if type(item) is int:
                if not -MAX_JSON_INT < item < MAX_JSON_INT:
                    raise BoundError(f"{what} holds an integer outside +-2**64")
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1))


def _short(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."
