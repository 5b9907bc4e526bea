"""Short soak (bench/soak.py) on a real kvferry P/D stack and router: ~80 requests (completions and chat,
streamed or not, 5-1500 prompt tokens) with one SIGSTOP of prefill (3-8 s, requests in flight), one
kill -9 of prefill and its restart with the same engine id, ports and side channel, and client cancels.

Asserts the soak's targets: no request lost (each ends with an answer or a clear error within its
total deadline), no avoidable error (a clear error before any token while one engine was up the whole
time: a recompute was possible), and every gauge back to 0 (vLLM running/waiting/KV usage and
kvferry_pending on both engines, router in-flight) after a bounded settle. The numbers are in the
test's output and in its `record_property` entries.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from kvferry.tools.pdstack import PdStack

# On the shared kvferry pair (tests/e2e/shared_stack.py); the soak itself ~2 min.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

_bench = Path(__file__).parents[2] / "bench"
sys.path.append(str(_bench))  # soak.py imports its sibling soak_report, as when run as a script
_spec = importlib.util.spec_from_file_location("bench_soak", _bench / "soak.py")
assert _spec is not None and _spec.loader is not None
soak = sys.modules["bench_soak"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(soak)

CONFIG = soak.Config(
    requests=80,
    concurrency=4,
    rate=1.0,
    plan=("stop-prefill", "kill-prefill"),
    fault_window=(0.1, 0.4),  # both faults early: requests keep flowing after P's restart
    stop_s=(3.0, 8.0),
    cancels=5,
    seed=7,
    tail=10,
    settle_s=90.0,
)


@pytest.mark.shared_stack("kvferry", breaks=True)
def test_short_soak_loses_nothing_and_settles(
    shared_stack: PdStack, tiny_model: Path, tmp_path: Path, record_property: Any
) -> None:
    summary = soak.run(CONFIG, tiny_model, tmp_path / "stack", stack=shared_stack)
    print("\n" + soak.table(summary))
    for key in ("requests", "ok", "recomputed", "errors", "avoidable", "cancelled", "lost"):
        record_property(key, summary[key])
    record_property("avoidable_by_code", json.dumps(summary["avoidable_by_code"]))
    assert summary["requests"] >= CONFIG.requests
    assert summary["lost"] == 0, json.dumps(summary["lost_examples"], indent=1)
    assert summary["gauges_ok"], {k: v for k, v in summary["gauges"].items() if v}
    assert summary["avoidable"] == 0, json.dumps(summary["avoidable_examples"], indent=1)
