"""A posted WRITE ends only when NIXL says DONE or ERR; one that outlives its consumer's deadline +
grace/2 fences the rank before anything drives NIXL again (connector/writes.py). The real-NIXL proof is
tests/nixl/test_restarts_and_deadlines.py; this pins the bookkeeping with a scripted transport."""

from __future__ import annotations

import pytest
from kvferry.connector.transport import WritePlan
from kvferry.connector.writes import InFlight, StuckWrite, Write


class ScriptedTransport:
    def __init__(self, states: dict[str, str]) -> None:
        self.states, self.polled, self.released = states, [], []

    def state(self, handle: str) -> str:
        self.polled.append(handle)
        return self.states[handle]

    def release(self, handle: str) -> None:
        self.released.append(handle)


def write(handle: str, must_end_by: float) -> Write:
    return Write((handle, 0), 0, "D", handle, 0.0, WritePlan("prepped", 1, 64, 0.0), must_end_by)


def test_a_running_write_is_never_reported_on_a_timer():
    t = ScriptedTransport({"a": "PROC"})
    flight = InFlight()
    flight.add(write("a", must_end_by=100.0))
    assert flight.check(t, now=99.0) == [] and t.released == []  # long-running, still inside its bound
    t.states["a"] = "ERR"
    (outcome,) = flight.check(t, now=99.5)
    assert (outcome.ok, outcome.reason, t.released, bool(flight)) == (False, "write_failed", ["a"], False)


def test_a_write_past_its_bound_fences_before_any_progress():
    t = ScriptedTransport({"a": "DONE", "b": "PROC"})
    flight = InFlight()
    flight.add(write("a", must_end_by=200.0))
    flight.add(write("b", must_end_by=100.0))
    with pytest.raises(StuckWrite, match=r"\('b', 0\).*past the consumer's deadline"):
        flight.check(t, now=100.5)
    assert t.polled == [] and t.released == []  # polling would push more of the WRITE
