"""First-event step: read the start of decode's SSE stream until it shows a token or an error.

vLLM answers a streaming request with status 200 before it has generated anything; when the KV
connector's load fails (`kv_load_failure_policy: fail`) the stream then carries only
`data: {"error": {...}}` and `data: [DONE]`. The router looks at the events up to the first one with
generated output, so such an error still counts as a failed leg (and is recomputed) instead of being
relayed as the answer. Content-free events before it (chat's role-only first chunk, usage) are kept
by the caller and relayed unchanged. Pure (no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.router import bounded

# Preamble bytes are held back from the client while they are scanned; past this much without a
# verdict the stream is treated as started (never buffer without a bound).
MAX_SCAN_BYTES = 1 << 20


@dataclass(frozen=True)
class FirstEvent:
    """The verdict on a stream's start: output (or the end of a stream), or an error event."""

    error: dict[str, Any] | None = None

    @property
    def message(self) -> str:
        err = self.error or {}
        return str(err.get("message") or err)

    @property
    def status(self) -> int | None:
        """The HTTP status vLLM put in the error's `code`, when it is one."""
        code = (self.error or {}).get("code")
        return code if isinstance(code, int) and 400 <= code <= 599 else None


class FirstEventScanner:
    """Feed raw bytes as they arrive; `feed` returns a verdict once one complete event decides."""

    def __init__(self) -> None:
        self._partial = b""
        self._seen = 0

    def feed(self, data: bytes) -> FirstEvent | None:
        self._seen += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            verdict = _line_verdict(line.strip())
            if verdict is not None:
                return verdict
        return FirstEvent() if self._seen > MAX_SCAN_BYTES else None


def _line_verdict(line: bytes) -> FirstEvent | None:
    if not line.startswith(b"data:"):
        return None  # blank separators, comments (`: ping`), event names
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return FirstEvent()
    try:
        event = bounded.loads(payload, "an event")
    except ValueError:
        return FirstEvent()  # not ours to judge: relay it as it is
    if not isinstance(event, dict):
        return FirstEvent()
    return _event_verdict(event)


def _event_verdict(event: dict[str, Any]) -> FirstEvent | None:
    error = event.get("error")
    if isinstance(error, dict) or (error and not event.get("choices")):
        return FirstEvent(error if isinstance(error, dict) else {"message": str(error)})
    if any(_has_output(c) for c in event.get("choices") or [] if isinstance(c, dict)):
        return FirstEvent()
    return None  # content-free: role-only chat chunk, usage-only chunk


def _has_output(choice: dict[str, Any]) -> bool:
    if choice.get("finish_reason") is not None or choice.get("text") or choice.get("token_ids"):
        return True
    return delta_has_output(choice.get("delta"))


def delta_has_output(delta: Any) -> bool:
    """A chat delta with anything generated (content, tool_calls, reasoning); the role alone is not."""
    return isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role")
