"""Prefill backlog: how long a new request would queue on each prefill engine, from the router's own legs.

Past saturation a prefill engine's queue grows without bound and so does every request's TTFT; the
in-flight limit alone cannot see it (256 short prompts and 256 long ones are not the same wait). The
router knows the prompt tokens of every prefill leg it has open on an engine and measures how fast the
engine finishes them while it is busy, so its estimate of a new request's wait is the tokens ahead of it
(its own included) divided by that rate. `limits.max_prefill_wait_s` refuses (429) a request whose
wait would exceed it, before it costs either engine anything (routing.py).

Pure: callers pass the clock. Busy time counts while at least one leg is open on the engine, so idle
gaps between requests never dilute the rate; a leg that failed frees its tokens without counting them
as work, while the time it held the engine still counts (an engine that times legs out looks slower).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Engine:
    outstanding: int = 0  # prompt tokens of this router's open prefill legs on the engine
    legs: int = 0
    busy_since: float | None = None  # when `legs` last went from 0 to 1
    window_busy_s: float = 0.0  # busy time and finished tokens since the last rate sample
    window_tokens: int = 0
    rate: float | None = None  # prompt tokens per busy second (moving average); None: not measured yet


class PrefillBacklog:
    """Per prefill engine (by URL): tokens queued and the measured rate at which it finishes them."""

    def __init__(self, window_s: float = 1.0, weight: float = 0.5) -> None:
        self.window_s = window_s  # busy time per rate sample: long enough to span several legs
        self.weight = weight  # of the newest sample in the moving average
        self.engines: dict[str, _Engine] = {}

    def started(self, url: str, tokens: int, now: float) -> None:
        e = self.engines.setdefault(url, _Engine())
        if e.legs == 0:
            e.busy_since = now
        e.legs += 1
        e.outstanding += tokens

    def finished(self, url: str, tokens: int, now: float, completed: bool = True) -> None:
        """A leg ended; `completed` False (it failed) frees its tokens without counting them as work."""
        e = self.engines.get(url)
        if e is None or e.legs == 0:
            return
        e.legs -= 1
        e.outstanding = max(0, e.outstanding - tokens)
        if e.busy_since is not None:
            e.window_busy_s += now - e.busy_since
            e.busy_since = now if e.legs else None
        e.window_tokens += tokens if completed else 0
        if e.window_busy_s >= self.window_s:
            sample = e.window_tokens / e.window_busy_s
            e.rate = sample if e.rate is None else self.weight * sample + (1 - self.weight) * e.rate
            e.window_busy_s, e.window_tokens = 0.0, 0

    def wait_s(self, url: str, tokens: int) -> float | None:
        """Seconds until a new request of `tokens` would be prefilled there; None while unmeasured or
        while none of our legs is open there: an idle engine starts it at once, whatever the rate says
        (after a stretch of failed legs the rate can be near 0, and refusing then would never let a
        new measurement happen)."""
        e = self.engines.get(url)
        if e is None or not e.rate or not e.legs:
            return None
        return (e.outstanding + tokens) / e.rate

    def forget(self, keep: set[str]) -> None:
        """Drop engines that left the pool once no leg of theirs is open."""
        for url in [u for u, e in self.engines.items() if u not in keep and e.legs == 0]:
            del self.engines[url]
