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

The publisher is a peer: every size in a batch is bounded before it is used (events per batch, blocks
and tokens per event, bytes per hash), an event past a bound is refused and counted, and a batch is
applied in slices of at most SLICE_UNITS blocks, so that the caller (router/kvfeed.py) can let the
event loop serve clients between slices: the time one batch holds the loop is bounded, whatever its size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from kvferry.router.prefix import chain_one, token_chunk

SEQ_BYTES = 8
MAX_HASH_BYTES = 64  # vLLM's block hashes: 32-byte digests, or 64-bit ints (msgpack bounds those)
# One event is one request's blocks in one engine step (a chunk of at most max_num_batched_tokens);
# decoding 65,536 token ids takes ~4 ms, the time one slice may hold the loop.
MAX_EVENT_TOKENS = 1 << 16
MAX_EVENT_BLOCKS = 1 << 12
MAX_BATCH_EVENTS = 1 << 16
# Work per slice: blocks stored or removed, and events decoded (5.7 us per block measured: ~6 ms).
SLICE_UNITS = 1024
_BYTES_PER_UNIT = 128  # a stored block is ~34 bytes of hash and 16-80 of token ids: size an event's decode

BlockHash = Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)] | int  # vLLM's ExternalBlockHash
Hashes = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]
_KNOWN = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: Hashes
    parent_block_hash: BlockHash | None
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_EVENT_TOKENS)]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: Hashes
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Frame(msgspec.Struct, array_like=True):
    ts: float
    # Each decoded on its own, when applied: an event type added by a newer vLLM is skipped.
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BATCH_EVENTS)]
    data_parallel_rank: int | None = None


class _Tag(msgspec.Struct):
    type: str = ""


@dataclass
class Batch:
    ts: float
    events: list[msgspec.Raw]  # encoded events, decoded one by one as the batch is applied


_frame = msgspec.msgpack.Decoder(_Frame)
_event = msgspec.msgpack.Decoder(Event)
_tag = msgspec.msgpack.Decoder(_Tag)


class EventError(ValueError):
    """A frame that is not a vLLM KV-event batch."""


def decode(payload: bytes) -> Batch:
    """The batch's frame (its events stay encoded: they are decoded as they are applied)."""
    try:
        frame = _frame.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError too: more than MAX_BATCH_EVENTS included
        raise EventError(f"not a vLLM KV-event batch: {exc}") from exc
    except RecursionError:  # msgspec's guard against nesting deeper than the interpreter allows
        raise EventError("not a vLLM KV-event batch: nested too deep") from None
    return Batch(frame.ts, frame.events)


def seq_of(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise EventError(f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big", signed=True)


@dataclass
class Change:
    """What (one slice of) a batch changed in an engine's cache, in the router's keys. Within one
    change, removals come before stores (a slice ends where a removal follows a store)."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    cleared: bool = False  # the cache was reset before this change's removals and stores
    skipped: int = 0  # stored blocks that could not be keyed (unknown parent, extra keys, other size)
    unknown: int = 0  # events of types this router does not know
    refused: int = 0  # events past a size bound (hash bytes, blocks, tokens) or not decodable

    def merge(self, later: Change) -> None:
        if later.cleared:
            self.stored, self.removed, self.cleared = [], [], True
        if later.removed:  # evicted after it was stored: no longer held
            gone = set(later.removed)
            self.stored = [k for k in self.stored if k not in gone]
        self.stored += later.stored
        self.removed += later.removed
        self.skipped += later.skipped
        self.unknown += later.unknown
        self.refused += later.refused


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

    def _take(self, seq: int, live: bool) -> bool:
        """Account for batch `seq`; False when it was already applied (a replay overlapping live)."""
        if live:
            self.last_live = seq
        if seq < self.next_seq:
            return False
        self.next_seq = seq + 1
        return True

    def lost(self, seq: int, live: bool = True) -> bool:
        """Batch `seq` could not be read: what it stored or evicted is unknown, so forget what the
        events told (the index must not keep blocks it may have evicted). False if already applied."""
        if not self._take(seq, live):
            return False
        self.keys.clear()
        return True

    def apply(self, seq: int, batch: Batch, live: bool = True) -> Change | None:
        """Apply one batch at once; None for a batch already applied."""
        parts = self.slices(seq, batch, live)
        if parts is None:
            return None
        total = Change()
        for part in parts:
            total.merge(part)
        return total

    def slices(
        self, seq: int, batch: Batch, live: bool = True, units: int = SLICE_UNITS
    ) -> Iterator[Change] | None:
        """Apply one batch lazily: each change yielded covers at most `units` blocks (or events); the
        state moves on as the iterator is consumed. None for a batch already applied."""
        if not self._take(seq, live):
            return None
        return self._slices(batch.events, max(1, units))

    def _slices(self, raws: list[msgspec.Raw], units: int) -> Iterator[Change]:
        change, used = Change(), 0
        for raw in raws:
            cost = 1 + len(raw) // _BYTES_PER_UNIT  # decoding a large event is work too
            if used and used + cost > units:
                yield self._cut(change)
                change, used = Change(), 0
            used += cost
            event = self._decode(raw, change)
            if isinstance(event, AllBlocksCleared):
                self.keys.clear()
                change = Change(cleared=True, skipped=change.skipped, unknown=change.unknown,
                                refused=change.refused)  # fmt: skip
            elif isinstance(event, BlockRemoved):
                if change.stored:  # keep the batch's order: stores so far go first
                    yield self._cut(change)
                    change, used = Change(), cost
                for vhash in event.block_hashes:
                    if used >= units:
                        yield self._cut(change)
                        change, used = Change(), 0
                    used += 1
                    key = self.keys.pop(vhash, None)
                    if key is not None:
                        change.removed.append(key)
            elif isinstance(event, BlockStored):
                parent = self._parent(event, change)
                if parent is None:
                    continue
                for i, vhash in enumerate(event.block_hashes):
                    if used >= units:
                        yield self._cut(change)
                        change, used = Change(), 0
                    used += 1
                    tokens = event.token_ids[i * self.block_tokens : (i + 1) * self.block_tokens]
                    parent = chain_one(parent, token_chunk(tokens))
                    self.keys[vhash] = parent
                    self.keys.move_to_end(vhash)
                    change.stored.append(parent)
        yield self._cut(change)

    def _cut(self, change: Change) -> Change:
        while len(self.keys) > self.max_blocks:
            self.keys.popitem(last=False)
        return change

    @staticmethod
    def _decode(raw: msgspec.Raw, change: Change) -> Event | None:
        try:
            return _event.decode(raw)
        except msgspec.ValidationError:
            pass
        except (msgspec.DecodeError, RecursionError):
            change.refused += 1
            return None
        try:
            known = _tag.decode(raw).type in _KNOWN
        except (msgspec.DecodeError, RecursionError):
            known = False
        if known:
            change.refused += 1  # a known event past a bound (hash bytes, blocks, tokens): refused
        else:
            change.unknown += 1  # a type (or shape) we do not know: ignore it, count it
        return None

    def _parent(self, event: BlockStored, change: Change) -> bytes | None:
        """The key of the block before the event's first, or None (counted skipped) if unkeyable."""
        n = len(event.block_hashes)
        if event.block_size != self.block_tokens or event.lora_id is not None or _has_extra(event.extra_keys):
            change.skipped += n
            return None
        parent = b"" if event.parent_block_hash is None else self.keys.get(event.parent_block_hash)
        if parent is None or len(event.token_ids) < n * self.block_tokens:
            change.skipped += n
            return None
        return parent


def _has_extra(extra: Sequence[Any] | None) -> bool:
    return any(extra or ())  # one entry per block, None where the block has no extra keys
