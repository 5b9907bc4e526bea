"""Aggregation step: read decode's SSE stream and build the one non-streaming OpenAI response from it.

The router asks decode for a stream even when the client did not, so it sees decode's first token
and can bound it (a decode stuck waiting for KV shows no first token; a non-streaming answer would
show nothing until the end). Requests whose answers carry more than text and token ids (logprobs,
echo, tools) are not aggregated; they go to decode non-streaming, bounded by the total deadline.
"""

from __future__ import annotations

from typing import Any

from kvferry.router import bounded

# The whole answer is held until it ends; decode picks its length (max_tokens and the engine).
MAX_AGGREGATED_BYTES = 64 << 20
_NOT_AGGREGATED = ("logprobs", "top_logprobs", "echo", "prompt_logprobs", "tools", "functions")


def can_aggregate(body: dict[str, Any]) -> bool:
    if body.get("stream") or any(body.get(k) not in (None, 1) for k in ("n", "best_of")):
        return False
    return all(_off(body.get(k)) for k in _NOT_AGGREGATED)


def _off(value: Any) -> bool:
    # Identity, not equality: logprobs 1 or True (== 1) and 0 (== False, the sampled token's
    # logprob) all ask for logprobs, which the aggregated answer would drop.
    return value is None or value is False or value == []


def streaming_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body as a stream that ends with a usage chunk (a shallow copy: stream_options is replaced,
    never changed in place)."""
    out = dict(body)
    out["stream"] = True
    out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    return out


class AnswerTooLarge(ValueError):
    """Decode's stream passed MAX_AGGREGATED_BYTES."""


class Aggregator:
    """Feed raw SSE bytes; `result()` is the non-streaming completion or chat completion. An event
    that is not a completion chunk sets `error` (decode's answer cannot be trusted past it)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._buf = b""
        self._head: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.done = False
        self._size = 0

    def feed(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > MAX_AGGREGATED_BYTES:
            raise AnswerTooLarge(f"the answer passed {MAX_AGGREGATED_BYTES} bytes")
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if line == b"data: [DONE]":
                self.done = True
            elif line.startswith(b"data: {") and self.error is None:
                try:
                    self._event(bounded.loads(line[6:], "an event"))
                except (ValueError, TypeError, AttributeError) as exc:  # not a completion chunk
                    self.error = {"message": f"malformed event: {str(exc)[:200]}"}

    def _event(self, event: dict[str, Any]) -> None:
        if "error" in event:
            self.error = event["error"] if isinstance(event["error"], dict) else {"message": str(event)}
            return
        if not self._head:
            self._head = {k: event.get(k) for k in ("id", "created", "model")}
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            self._merge(choice)

    def _merge(self, choice: dict[str, Any]) -> None:
        slot = self._choices.setdefault(
            int(choice.get("index", 0)), {"text": [], "token_ids": None, "finish_reason": None, "role": None}
        )
        piece = (choice.get("delta") or {}) if self.chat else choice
        slot["text"].append(str(piece.get("content") or piece.get("text") or ""))
        slot["role"] = slot["role"] or piece.get("role")
        if choice.get("token_ids") is not None:
            slot["token_ids"] = (slot["token_ids"] or []) + list(choice["token_ids"])
        for key in ("finish_reason", "stop_reason"):
            if choice.get(key) is not None:
                slot[key] = choice[key]

    def result(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self._choices):
            slot = self._choices[index]
            text = "".join(slot["text"])
            out: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": slot["finish_reason"]}
            if self.chat:
                out["message"] = {"role": slot["role"] or "assistant", "content": text}
            else:
                out["text"] = text
            if "stop_reason" in slot:
                out["stop_reason"] = slot["stop_reason"]
            if slot["token_ids"] is not None:
                out["token_ids"] = slot["token_ids"]
            choices.append(out)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head, "object": kind, "choices": choices, "usage": self.usage}
