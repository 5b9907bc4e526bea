"""Event framing: the client gets decode's stream as whole SSE events, framed as vLLM frames them.

vLLM writes each event as one `data: ...` line and one blank line, in one write. Some clients depend
on that: vLLM's own `vllm bench serve` strips every network read before it splits events on a blank
line, so a read that starts with a stray newline, or an event cut at a read boundary, glues two events
into one and fails the request (seen at 32 req/s: `JSONDecodeError: Extra data`). The router relays
what it reads from decode, and its reads need not end where an event ends; so every relayed write is
whole events only, with exactly one blank line after each, and nothing is left of a dropped event.
Pure (no I/O).
"""

from __future__ import annotations

from collections.abc import Iterator

# A stream that never ends an event within this many bytes is not framed as vLLM frames it: relay
# it as it comes rather than hold it (never buffer without a bound).
MAX_HELD_BYTES = 1 << 20
_ENDS = (b"\n\n", b"\r\n\r\n")


class EventFramer:
    """Feed raw bytes as they arrive; `feed` returns the complete events among them (possibly none),
    `flush` what is left at the end of the stream."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        buf = self._held + data
        end = max(buf.rfind(sep) + len(sep) if sep in buf else 0 for sep in _ENDS)
        if end == 0 and len(buf) > MAX_HELD_BYTES:
            end = len(buf)
        self._held = buf[end:]
        return buf[:end]

    def flush(self) -> bytes:
        rest, self._held = self._held, b""
        return rest


def events(framed: bytes) -> Iterator[bytes]:
    """The events of complete framed bytes, each without its blank line; empty events (stray blank
    lines) are skipped."""
    for event in framed.replace(b"\r\n", b"\n").split(b"\n\n"):
        if event.strip(b"\n"):
            yield event.strip(b"\n")


def frame(event: bytes) -> bytes:
    """One event as vLLM writes it: its lines, then one blank line."""
    return event + b"\n\n"
