"""KV events step (pure, no I/O): vLLM's KV-cache events -> the router's block keys an engine holds.

vLLM publishes what its prefix cache stores and evicts when started with `--kv-events-config`
(vllm/distributed/kv_events.py: ZMQ PUB frames `(topic, seq as 8 bytes big-endian, msgpack batch)`; a
batch is `[ts, events, data_parallel_rank]`, each event a map tagged by `type`). A `BlockStored` names
its blocks by vLLM's own hashes (seeded per process, not computable here) and carries their token ids
and the hash of the block before the first; `BlockRemoved` names evicted blocks; `AllBlocksCleared`
means the cache was reset. The router keys blocks its own way (router/prefix.py: chained hashes of
token ids), so each engine's state maps vLLM's hash -> the router's key, computed once from the token
ids and the parent's key. A stored block whose parent is unknown (stored before the router listened,
and not replayed) cannot be keyed and is skipped: the index then under-counts, never over-counts.

Only blocks of plain token prompts are keyed: blocks with extra keys (LoRA, multimodal inputs, a cache
salt) never match a prompt's keys, and blocks of another size than the router's `block_tokens` would
be keyed wrongly, so both are counted and skipped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from kvferry.router.prefix import chain_one, token_chunk

SEQ_BYTES = 8
BlockHash = bytes | int  # vLLM's ExternalBlockHash


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Frame(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]  # each decoded on its own: an event type added by a newer vLLM is skipped
    data_parallel_rank: int | None = None


@dataclass
class Batch:
    ts: float
    events: list[Event]
    unknown: int = 0  # events of types this router does not know


_frame = msgspec.msgpack.Decoder(_Frame)
_event = msgspec.msgpack.Decoder(Event)


class EventError(ValueError):
    """A frame that is not a vLLM KV-event batch."""


def decode(payload: bytes) -> Batch:
    try:
        frame = _frame.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventError(f"not a vLLM KV-event batch: {exc}") from exc
    batch = Batch(frame.ts, [])
    for raw in frame.events:
        try:
            batch.events.append(_event.decode(raw))
        except msgspec.ValidationError:
            batch.unknown += 1  # a type (or shape) we do not know: ignore it, count it
        except msgspec.DecodeError as exc:
            raise EventError(f"not a vLLM KV-event batch: {exc}") from exc
    return batch


def seq_of(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise EventError(f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big", signed=True)


@dataclass
class Change:
    """What one batch changed in an engine's cache, in the router's keys."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    cleared: bool = False
    skipped: int = 0  # stored blocks that could not be keyed (unknown parent, extra keys, other size)


@dataclass
class EngineBlocks:
    """One engine's blocks as its events told them: vLLM hash -> router key, at most `max_blocks`."""

    block_tokens: int
    max_blocks: int
    keys: OrderedDict[BlockHash, bytes] = field(default_factory=OrderedDict)
    next_seq: int = 0  # the sequence number expected next (vLLM's publisher counts from 0)
    last_live: int = -1  # the last sequence number seen on the live stream

    def gap(self, seq: int) -> bool:
        """Whether batches before live `seq` were missed (re-read them from the replay buffer)."""
        return seq > self.next_seq

    def restarted(self, seq: int) -> bool:
        """A live sequence number that went back: the publisher (the engine) started again."""
        return seq <= self.last_live

    def reset(self) -> None:
        """Forget everything (the engine restarted: its cache is empty, its numbering starts again)."""
        self.keys.clear()
        self.next_seq, self.last_live = 0, -1

    def apply(self, seq: int, batch: Batch, live: bool = True) -> Change | None:
        """Apply one batch; None for a batch already applied (a replay overlapping the live stream)."""
        if live:
            self.last_live = seq
        if seq < self.next_seq:
            return None
        self.next_seq = seq + 1
        change = Change()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event, change)
            elif isinstance(event, BlockRemoved):
                gone = (self.keys.pop(h, None) for h in event.block_hashes)
                change.removed += [k for k in gone if k is not None]
            elif isinstance(event, AllBlocksCleared):
                self.keys.clear()
                change = Change(cleared=True, skipped=change.skipped)
        return change

    def _stored(self, event: BlockStored, change: Change) -> None:
        n = len(event.block_hashes)
        if event.block_size != self.block_tokens or event.lora_id is not None or _has_extra(event.extra_keys):
            change.skipped += n
            return
        parent = b"" if event.parent_block_hash is None else self.keys.get(event.parent_block_hash)
        if parent is None or len(event.token_ids) < n * self.block_tokens:
            change.skipped += n
            return
        for i, vhash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * self.block_tokens : (i + 1) * self.block_tokens]
            parent = chain_one(parent, token_chunk(tokens))
            self.keys[vhash] = parent
            self.keys.move_to_end(vhash)
            change.stored.append(parent)
        while len(self.keys) > self.max_blocks:
            self.keys.popitem(last=False)


def _has_extra(extra: Sequence[Any] | None) -> bool:
    return any(extra or ())  # one entry per block, None where the block has no extra keys
