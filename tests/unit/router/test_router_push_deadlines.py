"""Push modes: D is never blamed for P's slowness. D's first-token clock starts when P's leg finished;
a prefill timeout marks P (not D) down and recomputes on D.

Deadlines here (engines.py): prefill_s 2, decode_first_token_s 1, transfer_s 0.5, total_s 4.
"""

from __future__ import annotations

import time

import pytest
from aiohttp.test_utils import TestClient
from kvferry.router.app import STATE

from tests.unit.router.engines import FakeEngine, router_state, run, stream_text

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 5}


def _up(client: TestClient) -> dict[str, bool]:
    static = client.server.app[STATE].config.static
    assert static is not None
    tracker = router_state(client).tracker
    return {role: tracker.is_up(static[role][0]) for role in ("prefill", "decode")}


@pytest.mark.parametrize("mode", ["kvferry", "vllm-push"])
@pytest.mark.parametrize("stream", [True, False])
def test_prefill_slower_than_decode_first_token_s_is_not_blamed_on_decode(mode: str, stream: bool) -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json={**BODY, "stream": stream})
        assert resp.status == 200, await resp.text()
        assert "X-Kvferry-Recomputed" not in resp.headers
        text = stream_text(await resp.text()) if stream else (await resp.json())["choices"][0]["text"]
        assert text == "from decode-0"
        assert _up(client) == {"prefill": True, "decode": True}
        assert len(p.seen) == 1, "no recompute on the slow prefill engine"

    # P takes 1.5 s (> decode_first_token_s 1, < prefill_s 2); D answers only after P finished.
    run(mode, "slow:1.5", "after_prefill", check)


@pytest.mark.parametrize("mode", ["kvferry", "vllm-push"])
def test_prefill_timeout_marks_prefill_down_and_recomputes_on_decode(mode: str) -> None:
    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        start = time.monotonic()
        resp = await client.post("/v1/completions", json={**BODY, "stream": True})
        raw = await resp.text()
        assert resp.status == 200 and resp.headers["X-Kvferry-Recomputed"] == "prefill_timeout"
        assert stream_text(raw) == "from decode-0"
        assert "kv_transfer_params" not in d.seen[-1]["body"], "the recompute is a plain request on D"
        assert _up(client) == {"prefill": False, "decode": True}
        assert time.monotonic() - start < 2 + 1.5

    run(mode, "stall", "after_prefill", check)


def test_non_streaming_decode_answer_is_bounded_by_the_total_deadline_only() -> None:
    """logprobs answers are not aggregated: D answers non-streaming, with nothing visible before its
    whole answer, which may take longer than any first-token bound."""

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json={**BODY, "logprobs": 2})
        assert resp.status == 200 and "X-Kvferry-Recomputed" not in resp.headers
        assert (await resp.json())["choices"][0]["text"] == "from decode-0"

    run("vllm-push", "ok", "slow:1.5", check)


def test_a_recompute_whose_target_died_falls_back_to_the_other_engine() -> None:
    """Decode waits for KV from a prefill that died after its leg: decode's first-token bound fails the
    leg, the recompute's target (prefill) refuses the connection, and decode, still running, serves
    the plain recompute instead of the client getting a 502 (seen with upstream push in CI)."""

    async def check(client: TestClient, p: FakeEngine, d: FakeEngine) -> None:
        resp = await client.post("/v1/completions", json={**BODY, "stream": True})
        raw = await resp.text()
        assert resp.status == 200, raw
        assert stream_text(raw) == "from decode-0"
        assert "kv_transfer_params" not in d.seen[-1]["body"], "the fallback is a plain request on D"
        assert len(d.seen) == 2  # its P/D leg, then the recompute

    run("vllm-push", "ok", "orphaned", check)
