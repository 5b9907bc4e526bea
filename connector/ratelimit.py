"""Rate-limited logging: one line per (logger, key) per interval, with a count of what was held back.

Why: errors caused by peers or hostile clients (garbage on a socket, floods) would otherwise let the
other side decide how much we log. The first occurrence of a key is logged at once; repeats within
`interval_s` are only counted, and the next occurrence after the interval carries the count
("... (and 1234 more like this in the last 10.0s)"). `flush()` reports counts of keys that went
quiet. Keys should be low-cardinality (a kind of error, not a client address): the key table is an
LRU of `max_keys` entries, which bounds memory, not the lines a stream of distinct keys produces.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

_SUMMARY = "%s (and %d more like this in the last %.1fs)"


class _Formatted:
    """`msg % args`, formatted only when a handler renders it (errors go to logging's handleError)."""

    __slots__ = ("msg", "args")

    def __init__(self, msg: str, args: tuple[object, ...]) -> None:
        self.msg, self.args = msg, args

    def __str__(self) -> str:
        return self.msg % self.args if self.args else self.msg


@dataclass
class _Window:
    start: float  # when the key's last line was logged
    level: int  # of the latest suppressed occurrence, for flush()
    suppressed: int = 0


class RateLimitedLog:
    """Thread-safe; `clock` is injectable (monotonic seconds) for tests."""

    def __init__(
        self,
        interval_s: float = 10.0,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or max_keys < 1:
            raise ValueError("interval_s must be > 0 and max_keys >= 1")
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: OrderedDict[tuple[str, Hashable], _Window] = OrderedDict()
        self.evicted = 0  # keys dropped from the LRU (their pending counts are lost)

    def __len__(self) -> int:
        return len(self._windows)

    def log(
        self, logger: logging.Logger, level: int, key: Hashable, msg: str, *args: object, **kw: Any
    ) -> bool:
        """Log `msg % args` unless (logger, key) logged within the interval; True if a line was written.

        `kw` goes to `Logger.log` (exc_info, extra); the record points at our caller.
        """
        if not logger.isEnabledFor(level):
            return False  # cheap path, and disabled levels do not consume the key's window
        held = self._admit((logger.name, key), level)
        if held is None:
            return False
        kw.setdefault("stacklevel", 2)
        if held[0]:
            logger.log(level, _SUMMARY, _Formatted(msg, args), *held, **kw)
        else:
            logger.log(level, msg, *args, **kw)
        return True

    def flush(self, force: bool = False) -> int:
        """Log the count of every key whose interval is over (all with `force`); returns lines logged."""
        now = self._clock()
        due: list[tuple[str, Hashable, int, int, float]] = []
        with self._lock:
            for (name, key), w in self._windows.items():
                if w.suppressed and (force or now - w.start >= self.interval_s):
                    due.append((name, key, w.level, w.suppressed, now - w.start))
                    w.start, w.suppressed = now, 0
        for name, key, level, count, elapsed in due:
            logging.getLogger(name).log(level, _SUMMARY, f"[{key}]", count, elapsed)
        return len(due)

    def _admit(self, ident: tuple[str, Hashable], level: int) -> tuple[int, float] | None:
        """None: suppress. Else (suppressed count, seconds it covers) to report with this line."""
        now = self._clock()
        with self._lock:
            w = self._windows.get(ident)
            if w is None:
                self._windows[ident] = _Window(now, level)
                self._evict()
                return (0, 0.0)
            self._windows.move_to_end(ident)
            if now - w.start < self.interval_s:
                w.suppressed += 1
                w.level = level
                return None
            held = (w.suppressed, now - w.start)
            w.start, w.suppressed = now, 0
            return held

    def _evict(self) -> None:
        while len(self._windows) > self.max_keys:
            self._windows.popitem(last=False)
            self.evicted += 1


_default = RateLimitedLog()


def log_limited(
    logger: logging.Logger, level: int, key: Hashable, msg: str, *args: object, **kw: Any
) -> bool:
    """`RateLimitedLog.log` on a process-wide instance (10 s interval, 1024 keys)."""
    kw.setdefault("stacklevel", 3)
    return _default.log(logger, level, key, msg, *args, **kw)
