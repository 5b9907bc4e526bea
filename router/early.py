"""First token from prefill (`streaming.first_token: prefill`): prefill's token goes to the client at once.

Prefill samples the request's first token anyway (its leg is a 1-token request). Sending it to a
streaming client the moment prefill's leg returns takes the KV transfer and decode's first step out of
TTFT. Decode still generates from the prompt's KV, so its own first token must be the same token, which
holds for a greedy request (temperature 0) and only for one: only those are eligible. The router asks
both legs for token ids, checks decode's first token against the one the client already got, and drops
decode's copy. A different token ends the stream with an error event (DecodeEcho raises Mismatch),
never a stream that continues from another token than the one the client holds.

Pure (no I/O): parsing prefill's answer into the chunk to send, and rewriting decode's stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvferry.contracts.params import prompt_tail
from kvferry.router import bounded
from kvferry.router.framing import EventFramer, events, frame
from kvferry.router.sse import delta_has_output

# Requests whose first event cannot be mirrored from a 1-token answer, or whose first token is not
# determined by the prompt's KV alone.
_NOT_ELIGIBLE = ("logprobs", "top_logprobs", "echo", "tools", "tool_choice", "functions", "response_format")


class Mismatch(Exception):
    """Decode's stream does not continue the token the client already got."""


def eligible(body: dict[str, Any], stream: bool) -> bool:
    """A streaming, greedy request whose first chunk the router can build from prefill's answer."""
    temperature = body.get("temperature")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0
    return stream and greedy and not any(body.get(name) for name in _NOT_ELIGIBLE)


@dataclass(frozen=True)
class FirstToken:
    """Prefill's token: its id, its text, and the SSE event that carries it to the client."""

    token_id: int
    text: str
    event: bytes


def first_token(answer: Any, chat: bool, want_ids: bool) -> FirstToken | None:
    """The first chunk of the client's stream, from prefill's non-streaming 1-token answer; None when
    the answer cannot be mirrored exactly (no single token id, tool calls or reasoning, a finish)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    if prompt_tail(answer):
        return None  # prefill left the prompt's last tokens to decode: its token is not the first

    choice = choices[0]
    ids = choice.get("token_ids")
    if not (isinstance(ids, list) and len(ids) == 1 and type(ids[0]) is int):
        return None
    if choice.get("finish_reason") not in (None, "length"):
        return None  # it stopped (EOS or a stop string): decode's stream says how, let it say so
    text = _chat_text(choice) if chat else choice.get("text")
    if not isinstance(text, str):
        return None
    out: dict[str, Any] = {"index": 0}
    if chat:
        out["delta"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    out.update(logprobs=None, finish_reason=None)
    if want_ids:
        out["token_ids"] = ids
    event = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": answer.get("created"),
        "model": answer.get("model"),
        "choices": [out],
    }
    return FirstToken(ids[0], text, frame(_data(event)))


def _chat_text(choice: dict[str, Any]) -> str | None:
    message = choice.get("message")
    if not isinstance(message, dict):
        return None
    if any(message.get(k) for k in ("tool_calls", "reasoning_content", "reasoning", "function_call")):
        return None
    content = message.get("content")
    return content if isinstance(content, str) else None


class DecodeEcho:
    """Rewrites decode's SSE stream after the client got `first`: drops chat's role-only chunk (the
    first chunk carried the role), checks that decode's first generated token is `first` and removes
    it, and strips token ids the client did not ask for. Feed raw bytes; get the bytes to relay, as
    whole events (framing.py): a dropped event leaves nothing behind, not even its blank line."""

    def __init__(self, first: FirstToken | None, chat: bool, want_ids: bool) -> None:
        """first None: the client got nothing from prefill (decode's token came first, or prefill's
        answer could not be mirrored); only the ids the client did not ask for are stripped."""
        self.first, self.chat, self.want_ids = first, chat, want_ids
        self.matched = first is None
        self._framer = EventFramer()

    def feed(self, data: bytes) -> bytes:
        return self._rewrite(self._framer.feed(data))

    def flush(self) -> bytes:
        """What is left at the end of the stream (a last event without its blank line)."""
        return self._rewrite(self._framer.flush())

    def _rewrite(self, framed: bytes) -> bytes:
        if self.matched and self.want_ids:
            return framed  # nothing left to change: relay as it came
        return b"".join(frame(out) for event in events(framed) if (out := self._event(event)) is not None)

    def _event(self, event: bytes) -> bytes | None:
        """The event to relay, or None to drop it."""
        lines = [self._line(line) for line in event.split(b"\n")]
        return None if None in lines else b"\n".join(line for line in lines if line is not None)

    def _line(self, line: bytes) -> bytes | None:
        stripped = line.strip()
        if not stripped.startswith(b"data:") or stripped[5:].strip() == b"[DONE]":
            return line
        try:
            event = bounded.loads(stripped[5:], "an event")
        except ValueError:  # BoundError too: nested past any parser's depth, relayed as it came
            return line
        if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
            return line
        if not self.want_ids:
            _strip_ids(event, keep_first=not self.matched)
        if not self.matched and not self._take_first(event):
            return None
        return _data(event)

    def _take_first(self, event: dict[str, Any]) -> bool:
        """Remove the already-sent token from the event that carries it; False: drop the event."""
        assert self.first is not None
        choices = [c for c in event["choices"] if isinstance(c, dict)]
        if not choices:
            return True  # usage-only and the like
        choice = choices[0]
        delta = choice.get("delta") if self.chat else None
        if self.chat and isinstance(delta, dict):
            delta.pop("role", None)
        ids = choice.get("token_ids") if self.want_ids else choice.pop("_ids", None)
        if not ids:
            if choice.get("finish_reason") is None and not _has_text(choice, self.chat):
                return False  # chat's role-only chunk: the first chunk already said it
            raise Mismatch(f"decode's stream carried output without token ids: {_brief(choice)}")
        if ids[0] != self.first.token_id:
            raise Mismatch(
                f"decode's first token {ids[0]} is not prefill's {self.first.token_id}, which the client "
                "already received; the stream cannot continue from it"
            )
        self.matched = True
        rest = ids[1:]
        if self.want_ids:
            choice["token_ids"] = rest
        self._drop_text(choice)
        return bool(rest) or choice.get("finish_reason") is not None or _has_text(choice, self.chat)

    def _drop_text(self, choice: dict[str, Any]) -> None:
        assert self.first is not None
        key, holder = ("content", choice.get("delta")) if self.chat else ("text", choice)
        if not isinstance(holder, dict):
            return
        text = holder.get(key) or ""
        if not text.startswith(self.first.text):
            raise Mismatch(f"decode's first text {text!r} does not start with prefill's {self.first.text!r}")
        holder[key] = text[len(self.first.text) :]


def _strip_ids(event: dict[str, Any], keep_first: bool) -> None:
    """Remove the ids the router asked for on the client's behalf; until the first token is checked
    they stay readable (as `_ids`) for the check, which removes them."""
    event.pop("prompt_token_ids", None)
    for choice in event["choices"]:
        if isinstance(choice, dict):
            ids = choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            if ids and keep_first:
                choice["_ids"] = ids


def _has_text(choice: dict[str, Any], chat: bool) -> bool:
    return delta_has_output(choice.get("delta")) if chat else bool(choice.get("text"))


def _brief(choice: dict[str, Any]) -> str:
    return json.dumps(choice)[:200]


def _data(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode()
