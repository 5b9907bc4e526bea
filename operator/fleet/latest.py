"""Latest step: workload checks that need a thread wait here, one per object, newest event wins.

A workload event whose shape moved is compared with the render (drift) on a reconcile thread. kopf
handles one object's events in order, so while that check waited for a thread (behind a wave of CR
reconciles) the object's worker stood still and every later event of it queued behind, each a whole
parsed body: in a creation wave, thousands (docs/benchmarks.md "Memory at 1,000 CRs"). Here
the handler leaves its check and returns; at most `slots` checks run at once, and a check submitted
while an older one of the same object still waits replaces it (the older event's body is let go: the
newer one says everything the older one did, and a deletion is never replaced by an older event).
Errors are logged, as kopf logged them for the handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

log = logging.getLogger("kvferry.operator")
Job = Callable[[], Awaitable[Any]]


class Latest:
    """Runs `job`s keyed by object, at most `slots` at once; a waiting job is replaced by a newer one."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.replaced = 0  # jobs let go for a newer one of the same key
        self._sem: asyncio.Semaphore | None = None
        self._waiting: dict[Hashable, Job] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """Jobs waiting for a slot."""
        return len(self._waiting)

    def submit(self, key: Hashable, job: Job) -> None:
        if key in self._waiting:
            self.replaced += 1
            self._waiting[key] = job
            return
        self._waiting[key] = job
        task = asyncio.get_running_loop().create_task(self._run(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: Hashable) -> None:
        self._sem = self._sem or asyncio.Semaphore(self.slots)
        async with self._sem:
            job = self._waiting.pop(key)
            try:
                await job()
            except Exception:
                log.exception("workload check of %s failed", key)

    async def drain(self) -> None:
        """Return when every submitted job has run (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))
