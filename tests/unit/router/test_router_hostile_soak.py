"""The router's hostile-input soak in CI's short form (bench/router_soak.py, the long form, documents
the scenario): hostile KV-event frames and clients that leave part-way against one router, bounded in
count; no crash, no leaked in-flight slot, detached prefill or open leg, the feed still following,
and no loop slice applying more than kvevents.SLICE_UNITS blocks."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from kvferry.router import kvevents

_path = Path(__file__).parents[3] / "bench" / "router_soak.py"
_spec = importlib.util.spec_from_file_location("bench_router_soak", _path)
assert _spec is not None and _spec.loader is not None
router_soak = sys.modules["bench_router_soak"] = importlib.util.module_from_spec(_spec)  # dataclasses
_spec.loader.exec_module(router_soak)


def test_hostile_frames_and_leaving_clients_crash_nothing_and_leak_nothing() -> None:
    figures = asyncio.run(
        asyncio.wait_for(router_soak.soak(frames=150, requests=150, concurrency=8, seed=3), 300)
    )
    assert figures.crashes == 0, figures
    assert figures.leaked == 0, figures
    assert figures.feed_alive, figures
    assert figures.requests.get("left", 0) > 50 and figures.requests.get("ok", 0) > 20, figures
    assert sum(figures.frames.values()) == 150 and figures.dropped.get("malformed", 0) > 0, figures
    assert 0 < figures.max_blocks_per_slice <= kvevents.SLICE_UNITS, figures
