"""streaming.first_token prefill: a greedy streaming client gets prefill's token as soon as prefill's
leg returns; decode's copy of it is checked by token id and dropped; a different token ends the stream
with an error event, never a stream continuing from a token the client does not hold."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import given
from hypothesis import strategies as st
from kvferry.router import early

from tests.unit.router.engines import CHAT_PATH, FakeEngine, run

FIRST = {"streaming": {"first_token": "prefill"}}
GREEDY = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": True, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 0.0}


def events(raw: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def text_of(evs: list[dict[str, Any]]) -> str:
    out = []
    for e in evs:
        for c in e.get("choices", []):
            out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def ids_of(evs: list[dict[str, Any]]) -> list[int]:
    return [i for e in evs for c in e.get("choices", []) for i in c.get("token_ids") or []]


# -- pure ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "stream", "ok"),
    [
        ({"temperature": 0}, True, True),
        ({"temperature": 0.0}, True, True),
        ({"temperature": 0}, False, False),  # nothing to send early without a stream
        ({}, True, False),  # vLLM's default temperature samples: decode's token may differ
        ({"temperature": 0.7}, True, False),
        ({"temperature": False}, True, False),
        ({"temperature": 0, "logprobs": 2}, True, False),
        ({"temperature": 0, "tools": [{"type": "function"}]}, True, False),
    ],
)
def test_only_greedy_streams_are_eligible(body: dict, stream: bool, ok: bool) -> None:
    assert early.eligible(body, stream) is ok


def answer(text: str = "He", ids: list[int] | None = None, chat: bool = False, **extra: Any) -> dict:
    choice: dict[str, Any] = {"index": 0, "token_ids": [5] if ids is None else ids, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    choice.update(extra)
    return {"id": "cmpl-r-0", "created": 7, "model": "tiny", "choices": [choice]}


def test_the_first_chunk_mirrors_prefills_answer() -> None:
    first = early.first_token(answer(), chat=False, want_ids=False)
    assert first is not None and first.token_id == 5
    (ev,) = events(first.event.decode())
    assert ev["id"] == "cmpl-r-0" and ev["object"] == "text_completion" and ev["created"] == 7
    assert ev["choices"] == [{"index": 0, "text": "He", "logprobs": None, "finish_reason": None}]
    chat = early.first_token(answer(chat=True), chat=True, want_ids=True)
    assert chat is not None
    (ev,) = events(chat.event.decode())
    assert ev["object"] == "chat.completion.chunk"
    assert ev["choices"][0]["delta"] == {"role": "assistant", "content": "He"}
    assert ev["choices"][0]["token_ids"] == [5]


@pytest.mark.parametrize(
    "bad",
    [
        answer(ids=[]),
        answer(ids=[5, 6]),
        answer(finish_reason="stop"),  # EOS or a stop string: decode's stream says how it ends
        answer(chat=True, message={"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}),
        {"choices": []},
        None,
        # a sliding-window model's prefill computed the prompt but its last token (connector/scheduler.py):
        # its one token follows a shorter prompt and is not the request's first
        {**answer(), "kv_transfer_params": {"kvferry": {"request_id": "r", "attempt": 0, "tail": 1}}},
    ],
)
def test_an_answer_that_cannot_be_mirrored_sends_nothing_early(bad: Any) -> None:
    assert early.first_token(bad, chat="message" in json.dumps(bad or {}), want_ids=False) is None


def sse(*evs: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in evs) + b"data: [DONE]\n\n"


D_STREAM = sse(
    {"choices": [{"index": 0, "text": "He", "token_ids": [5]}], "prompt_token_ids": [1, 2]},
    {"choices": [{"index": 0, "text": "llo", "token_ids": [9]}]},
    {"choices": [{"index": 0, "text": "!", "token_ids": [4], "finish_reason": "length"}]},
)


@given(st.lists(st.integers(1, len(D_STREAM) - 1), unique=True).map(sorted))
def test_decodes_copy_is_dropped_and_ids_stripped_however_the_bytes_arrive(cuts: list[int]) -> None:
    first = early.first_token(answer(), chat=False, want_ids=False)
    assert first is not None
    echo = early.DecodeEcho(first, chat=False, want_ids=False)
    pieces = [D_STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(D_STREAM)], strict=True)]
    out = (b"".join(echo.feed(p) for p in pieces) + echo.flush()).decode()
    assert text_of(events(out)) == "llo!" and ids_of(events(out)) == []
    assert "_ids" not in out and "prompt_token_ids" not in out and out.rstrip().endswith("data: [DONE]")


def test_wanted_ids_are_kept_after_the_first() -> None:
    first = early.first_token(answer(), chat=False, want_ids=True)
    assert first is not None
    echo = early.DecodeEcho(first, chat=False, want_ids=True)
    out = events((echo.feed(D_STREAM) + echo.flush()).decode())
    assert ids_of(out) == [9, 4] and text_of(out) == "llo!"


def test_chat_drops_decodes_role_chunk_and_its_first_token() -> None:
    first = early.first_token(answer(chat=True), chat=True, want_ids=False)
    assert first is not None
    stream = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "He"}, "token_ids": [5]}]},
        {"choices": [{"index": 0, "delta": {"content": "y"}, "token_ids": [8], "finish_reason": "stop"}]},
    )
    echo = early.DecodeEcho(first, chat=True, want_ids=False)
    out = events((echo.feed(stream) + echo.flush()).decode())
    assert out == [{"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": "stop"}]}]


def test_a_different_first_token_is_a_mismatch_not_a_silent_continuation() -> None:
    first = early.first_token(answer(ids=[6]), chat=False, want_ids=False)
    assert first is not None
    with pytest.raises(early.Mismatch, match="decode's first token 5 is not prefill's 6"):
        early.DecodeEcho(first, chat=False, want_ids=False).feed(D_STREAM)


def test_without_an_early_token_only_the_routers_ids_are_stripped() -> None:
    echo = early.DecodeEcho(None, chat=False, want_ids=False)
    out = events((echo.feed(D_STREAM) + echo.flush()).decode())
    assert text_of(out) == "Hello!" and ids_of(out) == []


# -- through the router ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["kvferry", "vllm-pull"])
def test_the_client_gets_prefills_token_first_and_the_answer_once(mode: str) -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json=GREEDY)
        evs = events(await resp.text())
        assert resp.status == 200 and evs[0]["created"] == 1, "the first event is prefill's answer"
        assert text_of(evs) == "from decode-0" and ids_of(evs) == [], "no token twice, no ids not asked for"
        assert p.seen[0]["body"]["return_token_ids"] and d.seen[0]["body"]["return_token_ids"]
        metrics = await (await client.get("/metrics")).text()
        assert "kvferry_router_first_token_from_prefill_total 1.0" in metrics

    run(mode, "ok", "after_prefill", check, **FIRST)


def test_chat_gets_the_role_once_and_ids_when_asked() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post(CHAT_PATH, json={**CHAT, "return_token_ids": True})
        evs = events(await resp.text())
        assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": "from"}
        assert [e for e in evs if "role" in e["choices"][0].get("delta", {})] == evs[:1]
        assert text_of(evs) == "from decode-0" and ids_of(evs) == [0, 1, 2]

    run("kvferry", "ok", "after_prefill", check, **FIRST)


def test_a_first_token_mismatch_ends_the_stream_with_an_error_event() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        p.first_id = 7
        resp = await client.post("/v1/completions", json=GREEDY)
        evs = events(await resp.text())
        assert resp.status == 200 and evs[0]["created"] == 1
        assert evs[-1]["error"]["code"] == "first_token_mismatch", evs
        assert "decode's first token 0 is not prefill's 7" in evs[-1]["error"]["message"]
        assert text_of(evs) == "from", "nothing after the token the client got"
        metrics = await (await client.get("/metrics")).text()
        assert 'reason="first_token_mismatch"} 1.0' in metrics

    run("kvferry", "ok", "after_prefill", check, **FIRST)


def test_sampled_requests_and_the_default_are_relayed_as_before() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        for body in ({**GREEDY, "temperature": 0.8}, {k: v for k, v in GREEDY.items() if k != "temperature"}):
            evs = events(await (await client.post("/v1/completions", json=body)).text())
            assert "created" not in evs[0] and text_of(evs) == "from decode-0"
            assert "return_token_ids" not in p.seen[-1]["body"]

    run("kvferry", "ok", "after_prefill", check, **FIRST)
