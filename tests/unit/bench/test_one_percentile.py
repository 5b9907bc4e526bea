"""tools/stats.py: the percentile every bench and tool reports, the same as numpy's default and
`statistics.quantiles(method="inclusive")`, so kvferry's client and `vllm bench serve` agree."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from kvferry.tools.stats import percentile, percentile_or_none


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([0.5, 0.7, 0.9], 90) == pytest.approx(0.86)
    assert percentile([5.0], 99) == 5.0
    assert percentile(iter([1.0, 3.0]), 50) == 2.0  # any iterable


def test_percentile_agrees_with_the_standard_library() -> None:
    rng = random.Random(7)
    for n in (2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        for q in (1, 50, 90, 99):
            assert percentile(values, q) == pytest.approx(cuts[q - 1])
        assert percentile(values, 50) == pytest.approx(statistics.median(values))


def test_no_values_is_nan_or_none_and_q_is_checked() -> None:
    assert math.isnan(percentile([], 50)) and percentile_or_none([], 50) is None
    assert percentile_or_none([2.0, 4.0], 50) == 3.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)
