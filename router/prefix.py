"""Prefix step: chained block hashes of a prompt, and which of them each engine holds (pure, no I/O).

The router does not tokenize. A prompt given as token ids is cut into blocks of `block_tokens` ids,
as vLLM cuts it; a text prompt (or a chat's messages, serialized in order) into blocks of
`block_tokens * chars_per_token` characters, an estimate of the same blocks. Each block's key hashes
its parent's key with its content, so equal keys mean equal prefixes up to and including that block
(vLLM's prefix cache works the same way); only full blocks count, as only full blocks are cached.

`PrefixIndex` remembers, per engine, the keys of the prompts the router sent it, in a bounded LRU:
what an engine held recently is what its prefix cache most likely still holds. Where the engine
publishes vLLM's KV-cache events (router/kvevents.py, router/kvfeed.py), those correct it: blocks it
cached (answers it generated included, which the router never sent) are added, blocks it evicted
removed. Engines that leave the pool are forgotten with their keys.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's chained block keys and its length in (estimated) tokens."""

    keys: tuple[bytes, ...]
    tokens: int  # exact for token-id prompts, estimated from characters for text
    tokens_per_key: int

    def hit_tokens(self, blocks: int) -> int:
        """Tokens covered by the first `blocks` keys."""
        return min(blocks * self.tokens_per_key, self.tokens)


def chain_one(parent: bytes, chunk: bytes) -> bytes:
    """A block's key: its content hashed together with the key before it (16-byte BLAKE2b)."""
    return hashlib.blake2b(parent + chunk, digest_size=16).digest()


def chained(chunks: Iterable[bytes]) -> tuple[bytes, ...]:
    """Key of each chunk, chained from the first (whose parent is b"")."""
    keys, parent = [], b""
    for chunk in chunks:
        parent = chain_one(parent, chunk)
        keys.append(parent)
    return tuple(keys)


def token_chunk(tokens: Sequence[int]) -> bytes:
    """A block of token ids as key content (router/kvevents.py keys vLLM's stored blocks with it too)."""
    return b"t" + ",".join(map(str, tokens)).encode()


def prompt_text(path: str, body: dict[str, Any]) -> str | list[int]:
    """What the engine will see first: the prompt (text or token ids), or the chat's messages in order
    (role and content; the chat template adds the same text around equal messages)."""
    if path == CHAT:
        return "".join(
            f"\x1e{m.get('role', '')}\x1f{_content(m.get('content'))}" for m in body.get("messages", [])
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return str(prompt or "")


def _content(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True)


def prompt_keys(prompt: str | list[int], block_tokens: int, chars_per_token: float) -> PromptKeys:
    """The full blocks' chained keys of a prompt (token ids, or text measured in characters)."""
    if isinstance(prompt, list):
        blocks = len(prompt) // block_tokens
        chunks = (token_chunk(prompt[i * block_tokens : (i + 1) * block_tokens]) for i in range(blocks))
        return PromptKeys(chained(chunks), len(prompt), block_tokens)
    block_chars = max(1, round(block_tokens * chars_per_token))
    tokens = round(len(prompt) / chars_per_token)
    starts = range(0, len(prompt) - block_chars + 1, block_chars)
    chunks = (b"s" + prompt[i : i + block_chars].encode() for i in starts)
    return PromptKeys(chained(chunks), tokens, block_tokens)


@dataclass
class PrefixIndex:
    """Per engine (by URL): the block keys it was sent or reported cached, most recent last, at most
    `max_blocks` each."""

    max_blocks: int
    held: dict[str, OrderedDict[bytes, None]] = field(default_factory=dict)

    def record(self, engine: str, keys: Sequence[bytes]) -> None:
        """The engine was sent a prompt with these keys: they are now its most recently used, the first
        block most of all (a shared prefix outlives the tails; vLLM also evicts tail blocks first)."""
        self._touch(engine, reversed(keys))

    def match(self, engine: str, keys: Sequence[bytes]) -> int:
        """How many leading blocks of the prompt the engine holds (a chain stops at its first miss)."""
        lru = self.held.get(engine)
        if not lru:
            return 0
        n = 0
        for key in keys:
            if key not in lru:
                break
            n += 1
        return n

    def stored(self, engine: str, keys: Sequence[bytes]) -> None:
        """The engine's KV events say it cached these blocks (router/kvevents.py): most recent now."""
        self._touch(engine, keys)

    def _touch(self, engine: str, keys: Iterable[bytes]) -> None:
        """Mark `keys` held by the engine, the last one most recently used; drop the least recent
        beyond max_blocks."""
        lru = self.held.setdefault(engine, OrderedDict())
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)

    def removed(self, engine: str, keys: Sequence[bytes]) -> None:
        """The engine's KV events say it evicted these blocks: it no longer holds them."""
        lru = self.held.get(engine, OrderedDict())
        for key in keys:
            lru.pop(key, None)

    def cleared(self, engine: str) -> None:
        """The engine's cache was reset (or the engine restarted): it holds nothing."""
        self.held.pop(engine, None)

    def forget(self, keep: set[str]) -> None:
        """Drop the engines that left the pool (pods come and go; their caches went with them)."""
        for engine in [e for e in self.held if e not in keep]:
            del self.held[engine]

    def blocks(self, engine: str) -> int:
        return len(self.held.get(engine, ()))
