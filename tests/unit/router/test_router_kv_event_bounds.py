"""router/kvevents.py against a hostile publisher: every size in a batch is bounded before it is used
(events per batch, blocks and tokens per event, bytes per hash), what is past a bound is refused and
counted, and a batch of any size is applied in slices of at most SLICE_UNITS blocks, in its order.
The real ZMQ path with the router's HTTP server: test_router_kv_feed_yields.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from kvferry.router import kvevents
from kvferry.router.prefix import PrefixIndex, prompt_keys

BLOCK = 4
_enc = msgspec.msgpack.Encoder()


def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "lora_id": None, "medium": "GPU", **kw}  # fmt: skip


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch(*events: dict[str, Any]) -> kvevents.Batch:
    return kvevents.decode(_enc.encode([1.5, list(events), 0]))


def test_a_large_batch_is_applied_in_bounded_slices_that_key_it_like_one() -> None:
    blocks = 3 * kvevents.SLICE_UNITS + 17
    tokens = [t % 100 for t in range(blocks * BLOCK)]
    half = blocks // 2
    events = [stored(list(range(half)), None, tokens[: half * BLOCK]),
              stored(list(range(half, blocks)), half - 1, tokens[half * BLOCK :])]  # fmt: skip
    state = kvevents.EngineBlocks(BLOCK, 10 * blocks)
    parts = state.slices(0, batch(*events))
    assert parts is not None
    changes = list(parts)
    assert len(changes) >= 4
    assert max(len(c.stored) for c in changes) <= kvevents.SLICE_UNITS
    assert [k for c in changes for k in c.stored] == list(prompt_keys(tokens, BLOCK, 4.0).keys)


def test_slices_keep_the_batch_order_a_block_stored_then_evicted_is_not_held() -> None:
    tokens = list(range(2 * BLOCK))
    state, index = kvevents.EngineBlocks(BLOCK, 100), PrefixIndex(100)
    parts = state.slices(0, batch(stored([b"a", b"b"], None, tokens), removed([b"b"])))
    assert parts is not None
    for change in parts:  # as router/kvfeed.py applies them
        index.removed("d", change.removed)
        index.stored("d", change.stored)
    assert index.match("d", prompt_keys(tokens, BLOCK, 4.0).keys) == 1
    both = batch(stored([b"a", b"b"], None, tokens), removed([b"b"]))
    merged = kvevents.EngineBlocks(BLOCK, 100).apply(0, both)
    assert merged is not None and len(merged.stored) == 1  # apply() merges slices the same way


def test_events_past_a_size_bound_are_refused_and_counted_not_applied() -> None:
    state = kvevents.EngineBlocks(BLOCK, 100)
    big_hash = b"h" * (kvevents.MAX_HASH_BYTES + 1)
    change = state.apply(0, batch(
        stored([big_hash], None, list(range(BLOCK))),  # a hash of any size would be kept as a key
        stored(list(range(kvevents.MAX_EVENT_BLOCKS + 1)), None, [0] * BLOCK),
        removed([b"x" * 100_000]),
        stored([b"ok"], None, list(range(BLOCK))),
        {"type": "SomethingNewer"},
    ))  # fmt: skip
    assert change is not None and change.refused == 3 and change.unknown == 1
    assert list(state.keys) == [b"ok"]  # the one well-formed event still applies


def test_a_batch_with_too_many_events_is_not_a_batch() -> None:
    payload = _enc.encode([1.0, [{"type": "AllBlocksCleared"}] * (kvevents.MAX_BATCH_EVENTS + 1), 0])
    with pytest.raises(kvevents.EventError, match="not a vLLM KV-event batch"):
        kvevents.decode(payload)


def test_nesting_deeper_than_the_interpreter_allows_is_a_broken_frame_not_a_crash() -> None:
    deep = b"\x91" * 200_000 + b"\x90"  # msgpack: a list in a list ... 200,000 deep
    with pytest.raises(kvevents.EventError, match="nested too deep"):
        kvevents.decode(b"\x93" + _enc.encode(1.0) + b"\x91" + deep + b"\x00")


def test_a_batch_that_cannot_be_read_forgets_the_engines_blocks() -> None:
    state = kvevents.EngineBlocks(BLOCK, 100)
    assert state.apply(0, batch(stored([b"a"], None, list(range(BLOCK))))) is not None
    assert state.lost(1) and state.keys == {} and state.next_seq == 2  # it may have evicted "a"
    assert not state.lost(1, live=False)  # a replay of it again: already accounted
