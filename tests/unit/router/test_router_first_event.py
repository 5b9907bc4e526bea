"""An error that arrives before decode's first token is a failed leg (recomputed), in every mode.

vLLM answers a streaming request whose KV load failed (`kv_load_failure_policy: fail`) with status
200 and an SSE error event; the router must not relay that as the answer.
"""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient

from tests.unit.router.engines import CHAT_PATH, FakeEngine, router_state, run, sse, stream_text

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 5}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


@pytest.mark.parametrize("mode", ["kvferry", "vllm-push", "vllm-pull"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/completions", CHAT_PATH])
def test_error_event_before_first_token_is_recomputed(mode: str, stream: bool, path: str) -> None:
    body = {**(CHAT if path == CHAT_PATH else COMPLETION), "stream": stream}

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Kvferry-Recomputed"] == "decode_error_event"
        if stream:
            raw = await resp.text()
            assert "error" not in raw and raw.endswith("data: [DONE]\n\n")
            assert stream_text(raw) == "from prefill-0"
        else:
            choice = (await resp.json())["choices"][0]
            assert (choice["message"]["content"] if path == CHAT_PATH else choice["text"]) == "from prefill-0"
        assert "kv_transfer_params" not in p.seen[-1]["body"], "the recompute is a plain request"
        metrics = await (await client.get("/metrics")).text()
        assert 'kvferry_router_leg_errors_total{leg="decode",reason="error_event"} 1.0' in metrics

    run(mode, "ok", "error_event", check)


def test_chat_preamble_split_across_reads_is_relayed_unchanged() -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post(CHAT_PATH, json={**CHAT, "stream": True})
        raw = await resp.read()
        assert resp.status == 200 and "X-Kvferry-Recomputed" not in resp.headers
        role = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        assert raw.startswith(role), raw[:200]
        assert stream_text(raw.decode()) == "from decode-0"

    run("kvferry", "ok", "ok", check)


def test_an_aggregated_answer_whose_stream_breaks_is_recomputed() -> None:
    """The client asked for one JSON answer and the router streams D (aggregate.py): when D dies
    after its first token, the client has seen nothing yet, so the router recomputes instead of
    answering 502."""

    async def check(client, p, d) -> None:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Kvferry-Recomputed"] == "decode_stream"
        assert (await resp.json())["choices"][0]["text"] == "from prefill-0"

    run("kvferry", "ok", "breaks", check)


def test_when_prefill_is_down_a_failed_receive_is_recomputed_on_decode() -> None:
    """P is down (the router saw it fail: cooling down) and D's KV load fails (an error event). The
    recompute must go to D, the engine that answered, not back to P. (The soak hit this: P killed,
    D's receive failed in the same millisecond as P's refused connection, recompute sent to dead P.)"""

    async def check(client, p, d) -> None:
        state = router_state(client)
        state.tracker.mark_down(state.discovery.current().prefill[0])
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": True})
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Kvferry-Recomputed"] == "decode_error_event"
        assert "from decode-0" in stream_text(await resp.text())

    run("kvferry", "stall", "error_event", check)
