"""The one poll helper of every test tier: wait until a condition holds, or fail naming what was awaited
and what was last observed. Tests order their steps by polling state (metrics, API objects, counters)
with it, never by sleeping a guessed time. `wait_until_async` is the same poll for code that runs in an
event loop (sleeping there must not block the loop)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

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
    poll = _Poll(probe, what, timeout_s, until, ignore)
    while not poll.done():
        time.sleep(interval_s)
    return poll.value


def wait_while_progressing(
    probe: Callable[[], T],
    what: str,
    progress: Callable[[], object],
    stall_s: float,
    timeout_s: float = 600.0,
    interval_s: float = 0.2,
    *,
    until: Callable[[T], object] = bool,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """`wait_until` bounded by progress, not by a guess of how fast a busy host is: keep polling while
    `progress()` (a count of work done: requests completed, restarts, ...) changes; fail when it has not
    changed for `stall_s`, or after `timeout_s` in all."""
    poll = _Poll(probe, what, timeout_s, until, ignore)
    seen, moved = progress(), time.monotonic()
    while not poll.done():
        now, current = time.monotonic(), progress()
        if current != seen:
            seen, moved = current, now
        elif now - moved > stall_s:
            raise WaitTimeout(f"no progress for {stall_s:g} s (still {seen!r}) while waiting for {what}")
        time.sleep(interval_s)
    return poll.value


async def wait_until_async(
    probe: Callable[[], T],
    what: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = 0.01,
    *,
    until: Callable[[T], object] = bool,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """`wait_until` inside an event loop: the loop runs on between probes."""
    poll = _Poll(probe, what, timeout_s, until, ignore)
    while not poll.done():
        await asyncio.sleep(interval_s)
    return poll.value


class _Poll(Generic[T]):
    def __init__(
        self,
        probe: Callable[[], T],
        what: str,
        timeout_s: float,
        until: Callable[[T], object],
        ignore: tuple[type[BaseException], ...],
    ) -> None:
        self.probe, self.what, self.timeout_s, self.until, self.ignore = probe, what, timeout_s, until, ignore
        self.deadline = time.monotonic() + timeout_s

    def done(self) -> bool:
        """Probe once: True when `until` holds (the value is in .value); WaitTimeout when time is up."""
        try:
            value = self.probe()
        except self.ignore as exc:
            last: object = exc
        else:
            if self.until(value):
                self.value = value
                return True
            last = value
        if time.monotonic() >= self.deadline:
            seen = repr(last)
            seen = seen if len(seen) <= MAX_SHOWN else seen[:MAX_SHOWN] + " ..."
            raise WaitTimeout(f"timed out after {self.timeout_s:g} s waiting for {self.what} (last: {seen})")
        return False
