"""The connector's hostile-input soak in CI's short form (bench/connector_soak.py, the long form,
documents the scenario): the protocol cores under honest requests mixed with ten kinds of hostile
messages, bounded in count; no crash, no round over its bound, no leaked entry, every honest request
received, and every bounded map within its bound."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kvferry.connector.protocol import Limits

_path = Path(__file__).parents[3] / "bench" / "connector_soak.py"
_spec = importlib.util.spec_from_file_location("bench_connector_soak", _path)
assert _spec is not None and _spec.loader is not None
connector_soak = sys.modules["bench_connector_soak"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(connector_soak)


def test_hostile_messages_crash_nothing_stall_nothing_and_leak_nothing() -> None:
    limits = Limits(max_entries=256, max_early_notices=512, max_notices_per_key=16)
    # The stall bound is two orders above what a round of 64 inputs takes here (a few ms), so a
    # loaded CI box cannot trip it; a scan per input (the old early-notice check) or an allocation
    # from a hostile layout costs whole seconds at these sizes.
    f = connector_soak.soak(requests=400, hostile=4000, seed=3, stall_s=1.0, limits=limits)
    assert (f.crashes, f.stalls, f.leaked) == (0, 0, 0), f
    assert f.received == 2 * f.requests and not f.failed, f
    assert f.peak["early_keys"] <= 256 and f.peak["early_notices"] <= 512 and f.peak["parked"] <= 256, f
    assert f.rejected.get("malformed", 0) > 0 and f.rejected.get("unexpected_rank", 0) > 0, f
    assert f.unverified_failures > 0, f  # made-up registrations drew no handshake
