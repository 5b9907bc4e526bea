"""Coalesce step: status refreshes batched and rate-limited per CR.

Workload watch events come in bursts (a StatefulSet's status moves several times while one pod starts;
1,000 CRs starting at once make thousands). Each used to cost one status patch, and each patch one more
CR watch event for kopf to process. Here an event only asks for a refresh of its CR; the refresh runs
at most once per `interval` per CR, reading the watched copies when it runs, so every event of the
window is folded into one patch. Requests are never dropped: one that arrives while its CR's refresh
runs schedules another after it.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("kvferry.operator")
RETRY_S = 5.0  # a refresh that raised runs again after this (the API server may be busy)
MAX_RETRIES = 3


class Coalescer:
    """Runs `work(key)` at most once per `interval` seconds per key, on `workers` threads."""

    def __init__(self, work: Callable[[Hashable], None], interval: float, workers: int = 4):
        self._work, self._interval = work, interval
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Hashable]] = []
        self._due: dict[Hashable, float] = {}  # pending key -> when it runs
        self._last: dict[Hashable, float] = {}  # key -> when its last run started
        self._running: set[Hashable] = set()
        self._again: set[Hashable] = set()  # requested while running: run once more after
        self._failures: dict[Hashable, int] = {}
        self._seq = 0
        self._closed = False
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvferry-status")
        self._thread = threading.Thread(target=self._dispatch, name="kvferry-coalesce", daemon=True)
        self._thread.start()

    def request(self, key: Hashable) -> None:
        """Ask for one run of `work(key)`; folded into a pending or running one where possible."""
        with self._cond:
            if key in self._running:
                self._again.add(key)
            elif key not in self._due:
                self._schedule(key, self._last.get(key, float("-inf")) + self._interval)

    def pending(self) -> int:
        with self._cond:
            return len(self._due) + len(self._running)

    def forget(self, key: Hashable) -> None:
        """A deleted CR: drop what is known of it (a pending run still runs and finds nothing)."""
        with self._cond:
            self._last.pop(key, None)
            self._failures.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _schedule(self, key: Hashable, when: float) -> None:
        when = max(when, time.monotonic())
        self._due[key] = when
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, key))
        self._cond.notify()

    def _dispatch(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._heap:
                    self._cond.wait()
                    continue
                when, _, key = self._heap[0]
                delay = when - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
                if self._due.get(key) != when:
                    continue  # superseded entry
                del self._due[key]
                self._running.add(key)
                self._last[key] = time.monotonic()
                self._pool.submit(self._run, key)

    def _run(self, key: Hashable) -> None:
        failed = False
        try:
            self._work(key)
        except Exception:  # logged and retried a bounded number of times: never silent, never lost
            failed = True
            log.exception("status refresh of %s failed", key)
        with self._cond:
            self._running.discard(key)
            tries = self._failures.pop(key, 0) + 1 if failed else 0
            if failed and tries <= MAX_RETRIES:
                self._failures[key] = tries
                self._schedule(key, time.monotonic() + RETRY_S)
            elif failed:
                log.error("status refresh of %s gave up after %d attempts", key, tries)
            if key in self._again:
                self._again.discard(key)
                if key not in self._due:
                    self._schedule(key, self._last[key] + self._interval)
