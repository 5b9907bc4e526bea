"""What a client or an engine hands the router is bounded before it is used: JSON nesting and integer
size (a 400 naming the limit, where Python's parser raised into a 500), body bytes (413, and engine
answers past a cap), and metric labels an engine's status would pick."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from kvferry.router import aggregate, dispatch
from kvferry.router.aggregate import Aggregator

from tests.unit.router.engines import FakeEngine, run


@pytest.mark.parametrize(
    "body,says",
    [
        ('{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", "not valid JSON"),  # > 4,300 digits
        ('{"prompt": "hi", "seed": ' + str(2**70) + "}", "integer outside"),
        ('{"prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper than 64"),
        ('{"prompt": "hi", "x": ' + "[" * 70 + "]" * 70 + "}", "nests deeper than 64"),  # under recursion
        ('{"prompt": "hi"', "not valid JSON"),
    ],
    ids=["int-5000-digits", "int-2**70", "nested-100000", "nested-70", "truncated"],
)
def test_bad_json_is_a_400_naming_what_is_wrong(body: str, says: str) -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_json" and says in error["message"]
        assert not p.seen and not d.seen

    run("kvferry", "ok", "ok", check)


def test_a_body_past_the_size_bound_is_a_413_error_body() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", data=b"{" + b" " * (33 << 20) + b"}")
        assert resp.status == 413
        assert "error" in await resp.json()

    run("kvferry", "ok", "ok", check)


def test_an_error_body_nested_past_any_parser_is_still_an_engine_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Kvferry-Recomputed"] == "decode_status_500"

    run("kvferry", "ok", "deep500", check)


def test_an_engine_status_picks_a_bounded_label() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert resp.status == 200 and resp.headers["X-Kvferry-Recomputed"] == "decode_status_5xx"
        metrics = await (await client.get("/metrics")).text()
        assert 'reason="status_5xx"' in metrics and "status_597" not in metrics

    run("kvferry", "ok", "error597", check)


def test_an_answer_past_its_cap_is_not_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "MAX_PREFILL_ANSWER_BYTES", 50_000, raising=False)

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Kvferry-Recomputed"] == "prefill_bad_answer"  # 100 kB from P: refused

    run("vllm-pull", "huge", "ok", check)


def test_an_aggregated_answer_is_bounded_and_a_malformed_event_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agg = Aggregator(chat=False)
    agg.feed(b'data: {"choices": 5}\n\n')  # not a completion chunk
    assert agg.error is not None and "malformed" in agg.error["message"]
    chat: Any = Aggregator(chat=True)
    chat.feed(b'data: {"choices": [{"index": 0, "delta": {"content": 7}}]}\n\n')
    assert chat.result()["choices"][0]["message"]["content"] == "7"
    monkeypatch.setattr(aggregate, "MAX_AGGREGATED_BYTES", 1000, raising=False)
    big = Aggregator(chat=False)
    with pytest.raises(ValueError, match="passed 1000 bytes"):
        for _ in range(100):
            big.feed(b'data: {"choices": [{"index": 0, "text": "xxxxxxxx"}]}\n\n')


def test_decodes_events_nested_past_any_parser_are_relayed_not_raised() -> None:
    from kvferry.router import early, sse

    deep = b"data: " + b"[" * 100_000 + b"\n\n"  # json.loads raised RecursionError on it
    assert sse.FirstEventScanner().feed(deep) is not None  # a verdict: relayed as it is
    assert early.DecodeEcho(None, chat=False, want_ids=False).feed(deep) == deep
