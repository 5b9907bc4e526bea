"""Changes step: what a managed object's watch event can have changed (pure bookkeeping, no I/O).

A workload's watch event used to cost a render (jinja2, the slowest step of a reconcile) and a drift
comparison, and then a status patch, whatever had changed. Most events only move a StatefulSet's or
Deployment's status (a pod became ready), and many (our own applies, kopf's annotations, the resource
version alone) change nothing the operator renders or the status shows. Each object's last seen
"shape" (everything the operator renders: spec, data, rules, labels, annotations, owners) and "status"
are kept as digests, so an event is sorted into: re-check drift (shape moved, or first sight), refresh
status (only status moved), or nothing.
"""

from __future__ import annotations

import enum
import hashlib
import json
import threading
from typing import Any

SHAPE_KEYS = ("spec", "data", "rules", "roleRef", "subjects", "automountServiceAccountToken")


class Change(enum.Enum):
    RECONCILE = "reconcile"  # the object is gone: re-apply everything
    CHECK = "check"  # something we render may have moved: compare with the render
    REFRESH = "refresh"  # only status moved: refresh the CR's status
    NONE = "none"


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def shape(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    owned = {k: obj.get(k) for k in SHAPE_KEYS if k in obj}
    owners = meta.get("ownerReferences")
    return _digest([owned, meta.get("labels"), meta.get("annotations"), owners])


def status_of(obj: dict[str, Any]) -> str:
    return _digest(obj.get("status"))


class Changes:
    """Last seen (shape, status) digest of each managed object, by uid; safe across kopf's threads."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def note(self, obj: dict[str, Any], event_type: str | None) -> Change:
        """Record `obj` as seen now and say what the event can have changed."""
        uid = (obj.get("metadata") or {}).get("uid", "")
        if event_type == "DELETED":
            with self._lock:
                self._seen.pop(uid, None)
            return Change.RECONCILE
        now = (shape(obj), status_of(obj))
        with self._lock:
            before = self._seen.get(uid)
            self._seen[uid] = now
        if event_type != "MODIFIED":
            return Change.NONE  # the initial listing or our own creation: the CR's reconcile covers it
        if before is None or before[0] != now[0]:
            return Change.CHECK
        return Change.REFRESH if before[1] != now[1] else Change.NONE
