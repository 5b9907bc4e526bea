"""Engine /metrics text, cut to what the operator reads before anything parses it (pure).

Engine pods run an image the CR's author chose, so their /metrics is untrusted input: even the parser
(kvferry.contracts.promtext) spends ~50 ms of CPU per MiB, on the operator's threads, for every pod
every interval, and a hostile text has no size of its own. So a text is cut first, cheaply (a prefix
test per line): only the families the operator reads (`kvferry_*`, and the `vllm:` ones transfer.py
and autoscale/signals.py name) and their `# TYPE` lines are kept, lines longer than MAX_LINE are
dropped, and at most MAX_LINES are kept. A real engine's relevant lines are a few hundred; what a
hostile text can cost is bounded by these. Failure reasons (label values a peer or the engine chose)
are cut to a known shape and count (`reason()`) before they reach status, events or condition messages.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_LINES = 4096  # kept lines per text: ~10x a busy engine's relevant ones
MAX_LINE = 1024  # characters; a label set longer than this is not one the operator reads
MAX_REASONS = 32  # distinct failure reasons kept per text; the rest count as "other"
OTHER = "other"
_REASON = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*[{ \t]")  # a sample line starts with its name, then { or blank


def _sample_like(line: str) -> bool:
    """A name first and a number last (the value, or the value and a timestamp): no backtracking,
    so a hostile line costs its length once."""
    if _NAME.match(line) is None:
        return False
    for token in reversed(line.rsplit(None, 2)[-2:]):
        try:
            float(token)
            return True
        except ValueError:
            continue
    return False


def relevant(text: str, names: Iterable[str]) -> str:
    """`text` with only the sample and `# TYPE` lines of the families starting with one of `names`.
    Raises ValueError on a line that is no exposition at all (an HTML page: the pod is not an engine)."""
    prefixes = tuple(names)
    types = tuple(f"# TYPE {p}" for p in prefixes)
    kept: list[str] = []
    for line in text.splitlines():
        if len(line) > MAX_LINE:
            continue
        if not (line.startswith(prefixes) or line.startswith(types)):
            if line and not line.startswith("#") and not _sample_like(line):
                raise ValueError(f"not Prometheus text: {line[:80]!r}")
            continue
        kept.append(line)
        if len(kept) >= MAX_LINES:
            break
    return "\n".join(kept) + "\n"


def reason(value: str, seen: dict[str, float], keep: frozenset[str] = frozenset()) -> str:
    """A failure reason as the operator may repeat it: the connector's snake_case vocabulary, or
    OTHER for anything else and for reasons beyond the first MAX_REASONS of one text (those in
    `keep`, the ones the operator acts on, are never lumped)."""
    if value in keep:
        return value
    if not _REASON.match(value):
        return OTHER
    if value not in seen and len(seen) >= MAX_REASONS:
        return OTHER
    return value
