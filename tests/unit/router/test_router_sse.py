"""The start of decode's SSE stream: wait past content-free events for output; flag error events."""

from __future__ import annotations

import json

from kvferry.router.sse import MAX_SCAN_BYTES, FirstEventScanner

from tests.unit.router.engines import sse


def _events(*events: object) -> bytes:
    return b"".join(sse(e) for e in events)


def test_scanner_waits_for_output_and_flags_errors() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    usage = {"choices": [], "usage": {"completion_tokens": 0}}
    text = {"choices": [{"index": 0, "text": "x"}]}
    scanner = FirstEventScanner()
    raw = _events(role, usage, text)
    assert all(scanner.feed(raw[i : i + 1]) is None for i in range(len(raw) - 2))
    verdict = scanner.feed(raw[-2:])  # the text event's closing newlines
    assert verdict is not None and verdict.error is None
    for started in (
        {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "t"}]}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
    ):
        verdict = FirstEventScanner().feed(_events(role, started))
        assert verdict is not None and verdict.error is None, started
    assert FirstEventScanner().feed(b"data: [DONE]\n\n") is not None
    error = FirstEventScanner().feed(_events(role, {"error": {"message": "boom", "code": 500}}))
    assert error is not None and error.message == "boom" and error.status == 500
    rejected = FirstEventScanner().feed(_events({"error": {"message": "bad", "code": 400}}))
    assert rejected is not None and rejected.status == 400
    plain = FirstEventScanner().feed(b'data: {"choices": [], "error": "overloaded"}\n\n')
    assert plain is not None and plain.message == "overloaded" and plain.status is None
    assert FirstEventScanner().feed(json.dumps(role).encode()) is None, "no data: line yet"
    assert FirstEventScanner().feed(b": ping\n" * (MAX_SCAN_BYTES // 7 + 1)) is not None, "bounded"
