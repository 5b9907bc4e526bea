"""Sample statistics the benches and tools report: one percentile for all of them."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in 0..100), linear between the two nearest ranks: numpy's default,
    `statistics.quantiles(method="inclusive")`, and what `vllm bench serve` reports, so the benches'
    two clients agree. NaN when there are no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentile_or_none(values: Iterable[float], q: float) -> float | None:
    """percentile(), but None when there are no values (null in a bench's JSON)."""
    value = percentile(values, q)
    return None if math.isnan(value) else value
