"""bench/prefix_bench.py's workload: seeded, multi-turn, one shared system prompt; each turn adds a user
message after the previous answer, which the client re-sends as the engine returned it (what prefix
caching and prefix-aware routing exploit); lengths within their bounds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "prefix_bench.py"


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("prefix_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["prefix_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_conversations_share_the_system_prompt_and_add_one_message_per_turn() -> None:
    pb = _bench()
    w = pb.Workload(system_tokens=100, conversations=6, turns=(2, 4), reply_tokens=8, seed=3)
    convs = pb.conversations(w)
    assert len(convs) == 6 and all(2 <= len(c) <= 4 for c in convs)
    assert len({len(c) for c in convs}) > 1  # turn counts vary
    system = convs[0][0].message[:100]
    for conv in convs:
        assert conv[0].message[:100] == system  # every conversation opens with the one system prompt
        assert w.user_bounds[0] <= len(conv[0].message) - 100 <= w.user_bounds[1]
        for turn in conv[1:]:  # later turns add a user message after the answer the client re-sends
            assert w.user_bounds[0] <= len(turn.message) <= w.user_bounds[1]
    assert convs[0][0].message[100:] != convs[1][0].message[100:]  # users differ after the system prompt
    assert pb.conversations(w) == convs  # seeded
    assert pb.conversations(pb.Workload(system_tokens=100, seed=4)) != pb.conversations(
        pb.Workload(system_tokens=100, seed=3)
    )
