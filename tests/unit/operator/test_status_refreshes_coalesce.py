"""Status patches batched and rate-limited per CR (issue 19): a burst of workload events for one CR
becomes one refresh; a request during a refresh is never lost; a failing refresh is retried, bounded."""

from __future__ import annotations

import threading
from collections import Counter

from kvferry.operator.fleet import coalesce
from kvferry.operator.fleet.coalesce import Coalescer

from tests.waiting import wait_until


def test_a_burst_of_requests_for_one_key_folds_into_one_run_per_interval() -> None:
    runs: Counter[str] = Counter()
    batcher = Coalescer(lambda key: runs.update([key]), interval=30.0)
    try:
        for _ in range(200):
            for key in ("a", "b"):
                batcher.request(key)
        wait_until(lambda: runs["a"] == 1 and runs["b"] == 1, "first run of each key", 10)
        batcher.request("a")  # inside a's interval: waits, never dropped
        assert batcher.pending() == 1 and runs["a"] == 1
    finally:
        batcher.close()


def test_a_request_during_a_run_causes_exactly_one_more_run() -> None:
    started, release, runs = threading.Event(), threading.Event(), Counter[str]()

    def work(key: str) -> None:
        runs[key] += 1
        started.set()
        release.wait(10)

    batcher = Coalescer(work, interval=0.0)
    try:
        batcher.request("a")
        assert started.wait(10)
        for _ in range(50):
            batcher.request("a")  # while running: folded into one more run
        release.set()
        wait_until(lambda: runs["a"] == 2 and batcher.pending() == 0, "the one follow-up run", 10)
    finally:
        batcher.close()
    assert runs["a"] == 2


def test_a_failing_refresh_is_retried_a_bounded_number_of_times(monkeypatch) -> None:
    monkeypatch.setattr(coalesce, "RETRY_S", 0.0)
    calls: Counter[str] = Counter()

    def work(key: str) -> None:
        calls[key] += 1
        raise RuntimeError("API server busy")

    batcher = Coalescer(work, interval=0.0)
    try:
        batcher.request("a")
        wait_until(lambda: batcher.pending() == 0 and calls["a"] > coalesce.MAX_RETRIES, "retries to end", 10)
    finally:
        batcher.close()
    assert calls["a"] == coalesce.MAX_RETRIES + 1
