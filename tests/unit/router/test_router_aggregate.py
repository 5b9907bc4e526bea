"""Aggregation: decode's SSE stream becomes the non-streaming OpenAI answer the client asked for."""

from __future__ import annotations

import json

from kvferry.router.aggregate import Aggregator, can_aggregate, streaming_body


def sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_completion_chunks_split_anywhere_aggregate_to_one_answer() -> None:
    raw = sse(
        {
            "id": "cmpl-1",
            "created": 5,
            "model": "tiny",
            "choices": [{"index": 0, "text": "he", "token_ids": [7]}],
        },
        {
            "id": "cmpl-1",
            "choices": [{"index": 0, "text": "llo", "token_ids": [8], "finish_reason": "length"}],
        },
        {"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    )
    agg = Aggregator(chat=False)
    for i in range(0, len(raw), 7):  # TCP may cut anywhere, even inside a line
        agg.feed(raw[i : i + 7])
    out = agg.result()
    assert agg.done and agg.error is None
    assert out["id"] == "cmpl-1" and out["object"] == "text_completion"
    assert out["choices"] == [
        {"index": 0, "logprobs": None, "finish_reason": "length", "text": "hello", "token_ids": [7, 8]}
    ]
    assert out["usage"]["completion_tokens"] == 2


def test_chat_deltas_and_errors() -> None:
    agg = Aggregator(chat=True)
    first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    agg.feed(sse(first, {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}))
    choice = agg.result()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hi"} and choice["finish_reason"] == "stop"
    assert "token_ids" not in choice
    broken = Aggregator(chat=True)
    broken.feed(sse({"error": {"message": "engine died", "code": 500}}))
    assert broken.error == {"message": "engine died", "code": 500}


def test_only_plain_text_requests_are_aggregated() -> None:
    assert can_aggregate({"prompt": "x", "max_tokens": 3})
    assert not can_aggregate({"prompt": "x", "stream": True})
    assert not can_aggregate({"prompt": "x", "logprobs": 2})
    for asks in ({"prompt": "x", "logprobs": 1}, {"prompt": "x", "logprobs": 0}, {"logprobs": True}):
        assert not can_aggregate(asks), f"{asks} asks for logprobs: aggregation would drop them"
    assert can_aggregate({"messages": [], "logprobs": False, "tools": [], "n": 1, "echo": None})
    assert not can_aggregate({"messages": [], "tools": [{"type": "function"}]})
    body = streaming_body({"prompt": "x", "stream_options": {"continuous_usage_stats": False}})
    assert body["stream"] is True
    assert body["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
