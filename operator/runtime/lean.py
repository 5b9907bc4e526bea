"""Lean watch events: every object kopf's watches deliver, without metadata.managedFields.

kopf parses each watch event into a whole body, queues it for the object's worker and keeps it while
the handlers run; in a creation wave hundreds are alive at once (docs/benchmarks.md "Memory at 1,000
CRs"). Of a server-side-applied object, managedFields (one field path per applied field, per manager)
are about as large as the rest; nothing reads them (kopf keeps its state in annotations, the operator
strips them from every index). `install` wraps kopf's `continuous_watch`, the one source of watch
events and initial listings, so each event drops them before it reaches a queue: the parse still
happens, but the field set is freed at once instead of riding along with the body.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from kopf._cogs.clients import watching

log = logging.getLogger("kvferry.operator")


def strip(event: Any) -> Any:
    """The event with its object's metadata.managedFields removed (in place); anything else as is."""
    obj = event.get("object") if isinstance(event, dict) else None
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return event


def lean(source: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """`source` (an async generator function of watch events) yielding stripped events."""

    @functools.wraps(source)
    async def stripped(**kwargs: Any) -> AsyncIterator[Any]:
        async for event in source(**kwargs):
            yield strip(event)

    stripped.__kvferry_lean__ = True  # type: ignore[attr-defined]
    return stripped


def install() -> bool:
    """Wrap kopf's watch source (once). False, with a warning, if this kopf has no such function: the
    operator then works as before, with the larger bodies."""
    source = getattr(watching, "continuous_watch", None)
    if source is None:
        log.warning("kopf has no watching.continuous_watch: watch events keep their managedFields")
        return False
    if not getattr(source, "__kvferry_lean__", False):
        watching.continuous_watch = lean(source)
    return True
