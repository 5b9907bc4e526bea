"""Recompute budget step: cap local recomputes at a fraction of recent requests plus a small burst.

A recompute runs the whole prompt again on the other engine. When a P or D fails under load, every
request through it would be recomputed and the pool would do up to twice the work just when it is
short of capacity; the budget turns the excess into quick, clear 503s instead. A token bucket: each
request adds `ratio` tokens, each recompute takes one, and at most `burst` tokens (at least one) are
kept, so only recent requests count. Pure (no I/O, no clock).
"""

from __future__ import annotations


class RecomputeBudget:
    def __init__(self, ratio: float, burst: int) -> None:
        self.ratio = ratio
        self.burst = burst
        self.tokens = float(burst)  # a fresh router may recompute a burst at once

    def deposit(self) -> None:
        """One request arrived."""
        self.tokens = min(max(self.burst, 1), self.tokens + self.ratio)

    def withdraw(self) -> bool:
        """Take one recompute; False when the budget is spent."""
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
