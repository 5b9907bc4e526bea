"""ratelimit: first line at once, repeats counted, one summary per interval, bounded key table."""

from __future__ import annotations

import logging
import threading

import pytest
from kvferry.connector.ratelimit import RateLimitedLog, log_limited

NAME = "kvferry.test.ratelimit"
LOG = logging.getLogger(NAME)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Lines:
    """The records logged during the test (caplog swaps its list between setup and call)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    def __getitem__(self, i: int) -> logging.LogRecord:
        return self.caplog.records[i]


@pytest.fixture
def lines(caplog) -> Lines:
    caplog.set_level(logging.DEBUG, logger=NAME)
    return Lines(caplog)


def messages(lines: Lines) -> list[str]:
    return [r.getMessage() for r in lines.caplog.records]


def test_first_line_is_logged_at_its_level_and_repeats_are_suppressed(clock, lines):
    limited = RateLimitedLog(interval_s=10.0, clock=clock)
    assert limited.log(LOG, logging.WARNING, "bad", "client %s sent %r", "1.2.3.4", b"x")
    for _ in range(5):
        clock.now += 1.0
        assert not limited.log(LOG, logging.WARNING, "bad", "client %s sent %r", "5.6.7.8", b"y")
    assert messages(lines) == ["client 1.2.3.4 sent b'x'"]
    assert lines[0].levelno == logging.WARNING
    assert lines[0].funcName == "test_first_line_is_logged_at_its_level_and_repeats_are_suppressed"


def test_line_after_the_interval_carries_the_suppressed_count(clock, lines):
    limited = RateLimitedLog(interval_s=10.0, clock=clock)
    limited.log(LOG, logging.INFO, "k", "dropped %d", 0)
    for i in range(1234):
        clock.now += 0.001
        limited.log(LOG, logging.INFO, "k", "dropped %d", i + 1)
    clock.now = 1010.0
    assert limited.log(LOG, logging.INFO, "k", "dropped %d", 9999)
    assert messages(lines) == ["dropped 0", "dropped 9999 (and 1234 more like this in the last 10.0s)"]
    clock.now = 1025.0  # a quiet interval: the next one is a plain line again
    limited.log(LOG, logging.INFO, "k", "dropped %d", 1)
    assert messages(lines)[-1] == "dropped 1"


def test_keys_and_loggers_are_limited_separately(clock, lines):
    limited = RateLimitedLog(interval_s=10.0, clock=clock)
    other = logging.getLogger(NAME + ".other")
    for _ in range(3):
        limited.log(LOG, logging.INFO, "a", "a")
        limited.log(LOG, logging.INFO, "b", "b")
        limited.log(other, logging.INFO, "a", "other a")
    assert messages(lines) == ["a", "b", "other a"]


def test_flush_reports_keys_that_went_quiet(clock, lines):
    limited = RateLimitedLog(interval_s=10.0, clock=clock)
    for _ in range(4):
        limited.log(LOG, logging.WARNING, "burst", "burst")
    assert limited.flush() == 0  # interval not over yet
    clock.now += 10.0
    assert limited.flush() == 1
    assert messages(lines)[-1] == "[burst] (and 3 more like this in the last 10.0s)"
    assert lines[-1].levelno == logging.WARNING
    assert limited.flush(force=True) == 0  # nothing pending any more
    limited.log(LOG, logging.WARNING, "burst", "burst")
    assert limited.flush(force=True) == 1


def test_key_table_is_a_bounded_lru(clock, lines):
    limited = RateLimitedLog(interval_s=10.0, max_keys=8, clock=clock)
    limited.log(LOG, logging.INFO, "hot", "hot")
    for i in range(10_000):  # a client spraying distinct keys
        limited.log(LOG, logging.INFO, f"spray-{i}", "spray")
        if i % 4 == 0:
            limited.log(LOG, logging.INFO, "hot", "hot")  # recently used: survives eviction
    assert len(limited) == 8
    assert limited.evicted == 10_001 - 8
    assert messages(lines).count("hot") == 1


def test_disabled_level_costs_no_window(clock, caplog):
    caplog.set_level(logging.INFO, logger=NAME)
    limited = RateLimitedLog(interval_s=10.0, clock=clock)
    assert not limited.log(LOG, logging.DEBUG, "k", "quiet")
    assert len(limited) == 0
    assert limited.log(LOG, logging.INFO, "k", "loud")


def test_concurrent_callers_log_one_line_and_lose_no_count(clock, lines):
    limited = RateLimitedLog(interval_s=10.0, clock=clock)
    start = threading.Barrier(8)

    def hammer() -> None:
        start.wait()
        for _ in range(1000):
            limited.log(LOG, logging.INFO, "k", "x")

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clock.now += 10.0
    limited.log(LOG, logging.INFO, "k", "x")
    assert messages(lines) == ["x", "x (and 7999 more like this in the last 10.0s)"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        RateLimitedLog(interval_s=0)
    with pytest.raises(ValueError):
        RateLimitedLog(max_keys=0)


def test_module_helper_logs_first_occurrence(lines):
    assert log_limited(LOG, logging.ERROR, ("test-module-helper", 1), "once %s", "only")
    assert not log_limited(LOG, logging.ERROR, ("test-module-helper", 1), "once %s", "again")
    assert messages(lines) == ["once only"]
    assert lines[0].funcName == "test_module_helper_logs_first_occurrence"
