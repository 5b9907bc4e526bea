"""Prefix-aware routing, pure parts: block keys, the per-engine index, load-bounded reuse, P/D or not."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.router.config import Endpoint
from kvferry.router.prefix import PrefixIndex, prompt_keys, prompt_text
from kvferry.router.scoring import Candidate, decide, pick


def test_keys_are_chained_over_full_blocks_only() -> None:
    a = prompt_keys(list(range(40)), 16, 4.0)
    b = prompt_keys([*range(32), 99, 98], 16, 4.0)
    assert len(a.keys) == 2 and a.tokens == 40  # the last 8 tokens are not a full block
    assert a.keys == b.keys  # same first 32 tokens
    c = prompt_keys([0, *range(1, 16), 7, *range(17, 32)], 16, 4.0)
    assert c.keys[0] == a.keys[0] and c.keys[1] != a.keys[1]
    d = prompt_keys([1, *range(1, 32)], 16, 4.0)
    assert d.keys[1] != a.keys[1]  # same second block, different first: a different chain


def test_text_is_measured_in_estimated_tokens() -> None:
    keys = prompt_keys("x" * 200, 16, 4.0)  # 64 characters per block
    assert keys.tokens == 50 and len(keys.keys) == 3 and keys.hit_tokens(2) == 32
    assert keys.hit_tokens(99) == 50


def test_chat_history_is_a_prefix_of_the_next_turn() -> None:
    turn1 = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "hello " * 30}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more " * 40}]
    k1 = prompt_keys(prompt_text("/v1/chat/completions", {"messages": turn1}), 16, 4.0)
    k2 = prompt_keys(prompt_text("/v1/chat/completions", {"messages": turn2}), 16, 4.0)
    assert k1.keys and k2.keys[: len(k1.keys)] == k1.keys
    other_system = [{"role": "system", "content": "t" * 300}, *turn1[1:]]
    k3 = prompt_keys(prompt_text("/v1/chat/completions", {"messages": other_system}), 16, 4.0)
    assert k3.keys[0] != k1.keys[0]


def test_index_matches_the_longest_held_prefix_and_stays_bounded() -> None:
    index = PrefixIndex(max_blocks=4)
    a = prompt_keys(list(range(64)), 16, 4.0).keys  # 4 blocks
    index.record("e1", a)
    assert index.match("e1", a) == 4 and index.match("e2", a) == 0
    b = prompt_keys([*range(32), *range(100, 132)], 16, 4.0).keys  # shares 2 blocks with a
    assert index.match("e1", b) == 2
    index.record("e1", b)  # 2 new blocks: the bound evicts a's least recent, its tail
    assert index.blocks("e1") == 4
    assert index.match("e1", b) == 4 and index.match("e1", a) == 2
    index.forget({"e2"})
    assert index.match("e1", a) == 0 and index.held == {}


def _ep(i: int) -> Endpoint:
    return Endpoint("decode", f"http://127.0.0.{i + 1}:8000", f"decode-{i}", "127.0.0.1", 5600)


candidates = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 8)), min_size=1, max_size=6).map(
    lambda xs: [Candidate(_ep(i), float(load), (float(load), i), hit) for i, (load, hit) in enumerate(xs)]
)


@settings(max_examples=200, derandomize=True)
@given(candidates, st.integers(0, 5))
def test_reuse_wins_only_within_the_load_bound(cands: list[Candidate], bound: int) -> None:
    chosen = pick(cands, bound)
    least = min(c.load for c in cands)
    assert chosen.load <= least + bound  # a hot prefix never piles beyond the bound
    eligible = [c for c in cands if c.load <= least + bound]
    assert chosen.hit_blocks == max(c.hit_blocks for c in eligible)
    if all(c.hit_blocks == 0 for c in cands):
        assert chosen == min(cands, key=lambda c: c.rank)  # no prefix anywhere: load alone


def test_a_hot_prefix_spreads_once_its_holder_is_busier_than_the_bound() -> None:
    holder, idle = _ep(0), _ep(1)
    assert pick([Candidate(holder, 2, (2, 0), 8), Candidate(idle, 0, (0, 1), 0)], 2).endpoint == holder
    assert pick([Candidate(holder, 3, (3, 0), 8), Candidate(idle, 0, (0, 1), 0)], 2).endpoint == idle
    with pytest.raises(ValueError):
        pick([], 2)


@pytest.mark.parametrize(
    ("rule", "prompt", "hit", "p_hit", "path", "reason"),
    [
        ("always", 10, 0, 0, "pd", "always"),
        ("always", 5000, 5000, 0, "pd", "always"),
        ("selective", 100, 0, 0, "decode_only", "short_prompt"),
        ("selective", 1000, 0, 0, "pd", "prefill_pays"),
        ("selective", 1000, 850, 0, "decode_only", "decode_holds_prefix"),  # holds >= 80 %
        ("selective", 10000, 7900, 0, "pd", "prefill_pays"),  # holds 79 %, lacks 2100 >= 256
        ("selective", 1000, 760, 0, "decode_only", "decode_holds_prefix"),  # lacks 240 < 256
        ("selective", 0, 0, 0, "decode_only", "short_prompt"),
        ("selective", 1000, 850, 850, "decode_only", "decode_holds_prefix"),  # both hold as much
        ("selective", 1000, 850, 900, "pd", "prefill_holds_more"),  # alone, D would compute more
        ("selective", 100, 0, 64, "pd", "prefill_holds_more"),
        ("selective", 1000, 0, 900, "pd", "prefill_pays"),
    ],
)
def test_disaggregation_decision(
    rule: str, prompt: int, hit: int, p_hit: int, path: str, reason: str
) -> None:
    decision = decide(rule, 256, 0.8, prompt, hit, p_hit)
    assert (decision.path, decision.reason) == (path, reason)


@settings(max_examples=300, derandomize=True)
@given(st.integers(0, 4000), st.integers(0, 4000), st.integers(0, 4000), st.integers(0, 512))
def test_decode_alone_never_computes_more_than_pd_would(prompt: int, d: int, p: int, least: int) -> None:
    d, p = min(d, prompt), min(p, prompt)
    decision = decide("selective", least, 0.8, prompt, d, p)
    if decision.path == "decode_only":
        assert prompt - d <= prompt - p  # decode's own compute vs prefill's in P/D
        assert prompt - d < least or d >= 0.8 * prompt
