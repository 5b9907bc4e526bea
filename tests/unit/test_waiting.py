"""tests/waiting.py: the poll helper every tier uses returns the first truthy value or fails saying what
it waited for and what it last saw."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.waiting import WaitTimeout, wait_until, wait_until_async, wait_while_progressing


def test_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", {"ready": 2}])
    assert wait_until(lambda: next(values), "a value", timeout_s=5, interval_s=0.001) == {"ready": 2}


def test_fails_naming_what_and_the_last_value() -> None:
    counts = iter(range(10**6))
    with pytest.raises(WaitTimeout, match=r"after 0.05 s waiting for 100 requests \(last: \d+\)") as failed:
        wait_until(lambda: next(counts), "100 requests", 0.05, 0.01, until=lambda n: n >= 10**6)
    assert isinstance(failed.value, AssertionError)  # a test failure, not an error


def test_until_judges_what_the_probe_observed() -> None:
    gauges = iter([{"running": 2, "waiting": 1}, {"running": 1, "waiting": 0}, {"running": 0, "waiting": 0}])
    idle = wait_until(lambda: next(gauges), "idle", 5, 0.001, until=lambda g: not any(g.values()))
    assert idle == {"running": 0, "waiting": 0}


def test_ignored_exceptions_mean_not_yet_and_are_reported() -> None:
    calls = itertools.count()

    def flaky() -> bool:
        if next(calls) < 3:
            raise ConnectionError("refused")
        return True

    assert wait_until(flaky, "a server", 5, 0.001, ignore=(ConnectionError,)) is True

    def refused() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(WaitTimeout, match=r"last: ConnectionError\('refused'\)"):
        wait_until(refused, "a server", 0.05, 0.01, ignore=(ConnectionError,))


def test_other_exceptions_propagate() -> None:
    with pytest.raises(ZeroDivisionError):
        wait_until(lambda: 1 / 0, "a division", 5, ignore=(ConnectionError,))


def test_a_progressing_wait_goes_on_while_work_moves_and_fails_when_it_stalls() -> None:
    done = itertools.count()  # each poll completes one more request: progress past any stall_s
    polls = iter(range(10**6))
    assert wait_while_progressing(
        lambda: next(polls) >= 20, "twenty polls", lambda: next(done), 0.0, 5, 0.001
    )
    with pytest.raises(WaitTimeout, match=r"no progress for 0.05 s \(still 7\) while waiting for in-flight"):
        wait_while_progressing(lambda: 0, "in-flight", lambda: 7, 0.05, 5, 0.01)
    with pytest.raises(WaitTimeout, match=r"after 0.05 s waiting for never"):
        wait_while_progressing(lambda: 0, "never", lambda: next(done), 5, 0.05, 0.01)


def test_the_async_poll_lets_the_loop_run_between_probes() -> None:
    async def main() -> list[str]:
        events: list[str] = []

        async def later() -> None:
            await asyncio.sleep(0.02)
            events.append("done")

        task = asyncio.create_task(later())
        assert await wait_until_async(lambda: events, "the task's event", 5) == ["done"]
        await task
        with pytest.raises(WaitTimeout, match=r"waiting for nothing \(last: \[\]\)"):
            await wait_until_async(list, "nothing", 0.05)
        return events

    assert asyncio.run(main()) == ["done"]
