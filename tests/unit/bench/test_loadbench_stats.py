"""Load bench statistics: seeded Poisson arrivals, percentiles, per-cell summaries and the table."""

from __future__ import annotations

import math
import random

from kvferry.connector.loadbench import Result, arrivals, markdown, percentile, prompts, summarize


def test_arrivals_are_seeded_and_have_the_asked_mean_rate() -> None:
    a = arrivals(4.0, 2000, random.Random("s"))
    assert a == arrivals(4.0, 2000, random.Random("s"))
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    assert abs((len(a) - 1) / a[-1] - 4.0) < 0.4


def test_percentile_interpolates_and_handles_empty() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_prompts_have_exact_lengths_and_differ() -> None:
    batch = prompts(300, 3, 2000, random.Random(0))
    assert [len(p) for p in batch] == [300, 300, 300]
    assert batch[0][:16] != batch[1][:16], "no shared prefix between prompts"


def test_summary_counts_failures_and_reports_ms() -> None:
    results = [Result(True, ttft_s=0.010, tpot_s=0.002, e2e_s=0.1, tokens=32) for _ in range(9)]
    results.append(Result(False, error="HTTP 503"))
    cell = summarize(256, 2.0, results, wall_s=5.0)
    assert (cell.ok, cell.failed, cell.errors) == (9, 1, ["HTTP 503"])
    assert abs(cell.ttft_ms["p50"] - 10.0) < 1e-9 and abs(cell.tpot_ms["p99"] - 2.0) < 1e-9
    table = markdown([cell], "single")
    assert "| 256 | 2 | 9/1 | 10.0 / 10.0 | 2.00 / 2.00 | 100 | 1.80 |" in table
