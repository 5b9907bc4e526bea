"""The one poll helper of every test tier: wait until a condition holds, or fail naming what was awaited
and what was last observed. Tests order their steps by polling state (metrics, API objects, counters)
with it, never by sleeping a guessed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Generous: every tier shares two cores with other test runs; a poll that succeeds returns at once.
DEFAULT_TIMEOUT_S = 120.0
MAX_SHOWN = 2000  # characters of the last value in the failure message


class WaitTimeout(AssertionError):
    """The condition did not hold in time (an assertion failure of the test that waited)."""


def wait_until(
    probe: Callable[[], T],
    what: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = 0.2,
    *,
    until: Callable[[T], object] = bool,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `probe` every `interval_s` until `until(value)` holds (by default: until the value is
    truthy), and return that value. After `timeout_s`, raise WaitTimeout naming `what` and the last
    value seen: pass a probe that observes (a counter, the gauges) and an `until` that judges, and a
    failure shows what was observed, not just False. Exceptions of the `ignore` types count as "not
    yet" (e.g. a server that does not answer while it starts) and are reported as the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = probe()
        except ignore as exc:
            last: object = exc
        else:
            if until(value):
                return value
            last = value
        if time.monotonic() >= deadline:
            seen = repr(last)
            seen = seen if len(seen) <= MAX_SHOWN else seen[:MAX_SHOWN] + " ..."
            raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what} (last: {seen})")
        time.sleep(interval_s)
