"""Faults on a real P/D pair (upstream push, concurrent legs): every request ends within its deadline,
by a local recompute (same greedy tokens as a single instance) or a clear error, never a hang.

The tests share one pair and pass alone and in any order: each starts from a live, idle pair (an engine
a previous test paused is resumed, one it killed is restarted, and nothing runs on the engines or the
router), and steps inside a test wait for observed state (metrics), never for a guessed time.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.pdclient import completion_body
from kvferry.tools.pdstack import PdStack
from kvferry.tools.serve import VllmProcess

from tests.waiting import wait_until

# Setup starts vLLM servers: on a shared 2-core host that alone can take minutes.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800), pytest.mark.shared_stack("vllm-push", breaks=True)]
DEADLINES = {"prefill_s": 20, "decode_first_token_s": 10, "transfer_s": 10, "total_s": 45}


@pytest.fixture
def stack(shared_stack: PdStack) -> PdStack:
    """The shared upstream-push pair (live and idle whatever ran before) behind a router of our deadlines."""
    shared_stack.reroute(DEADLINES)
    return shared_stack


def _router_metrics(pd: PdStack) -> dict[str, float]:
    return parse_metrics(httpx.get(pd.url + "/metrics", timeout=10).text)


def _requests(server: VllmProcess) -> float:
    """Requests the engine is running or has queued."""
    m = server.metrics()
    return metric_sum(m, "vllm:num_requests_running") + metric_sum(m, "vllm:num_requests_waiting")


def _wait_idle(pd: PdStack, timeout_s: float = 20.0) -> None:
    """D has no running or waiting request left (aborted requests were really dropped)."""
    wait_until(
        lambda: _requests(pd.server("decode")),
        "decode idle after the client left",
        timeout_s,
        0.5,
        until=lambda n: n == 0,
    )


def test_client_disconnect_mid_stream_aborts_decode_cleanly(
    stack: PdStack, reference: dict[str, Any]
) -> None:
    body = {**completion_body(700, stream=True), "max_tokens": 400}

    async def leave_after_first_chunk() -> None:
        url = stack.url + "/v1/completions"
        async with httpx.AsyncClient(timeout=30) as client, client.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            async for _ in resp.aiter_bytes():
                break  # hang up after the first tokens

    asyncio.run(leave_after_first_chunk())
    _wait_idle(stack)
    assert (
        metric_sum(_router_metrics(stack), "kvferry_router_requests_total", outcome="client_disconnect") >= 1
    )
    after = httpx.post(stack.url + "/v1/completions", json=completion_body(129), timeout=60).json()
    assert after["choices"][0]["token_ids"] == reference["len129"]["token_ids"]


def test_client_abort_before_first_token_lets_prefill_finish(
    stack: PdStack, reference: dict[str, Any]
) -> None:
    assert stack.prefill is not None
    before = metric_sum(stack.prefill.metrics(), "vllm:generation_tokens_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(stack.url + "/v1/completions", json=completion_body(1500), timeout=0.05)
    # The prefill leg goes on without its client (cancelling it would strand decode).
    wait_until(
        lambda: metric_sum(stack.prefill.metrics(), "vllm:generation_tokens_total"),
        "the prefill leg to finish after its client left",
        20,
        0.3,
        until=lambda n: n > before,
    )
    _wait_idle(stack)
    after = httpx.post(stack.url + "/v1/completions", json=completion_body(300), timeout=60).json()
    assert after["choices"][0]["token_ids"] == reference["len300"]["token_ids"]


def test_decode_that_never_registers_is_recomputed_on_prefill(
    stack: PdStack, reference: dict[str, Any]
) -> None:
    stack.pause("decode")  # D accepts connections but never registers or answers
    try:
        start = time.monotonic()
        resp = httpx.post(stack.url + "/v1/completions", json=completion_body(129, stream=True), timeout=60)
        elapsed = time.monotonic() - start
    finally:
        stack.resume("decode")
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Kvferry-Recomputed"] == "decode_timeout"
    assert elapsed < DEADLINES["decode_first_token_s"] + 15
    text = "".join(
        c.get("text", "")
        for line in resp.text.splitlines()
        if line.startswith("data: {")
        for c in json.loads(line[6:]).get("choices", [])
    )
    assert text == reference["stream129"]["text"]


def test_prefill_killed_mid_request_is_recomputed_on_decode(
    stack: PdStack, reference: dict[str, Any]
) -> None:
    stack.pause("prefill")  # hold P inside the request, then kill it

    def legs_in_flight() -> dict[str, float]:
        m = _router_metrics(stack)
        return {role: metric_sum(m, "kvferry_router_in_flight", role=role) for role in ("prefill", "decode")}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            call = asyncio.create_task(client.post(stack.url + "/v1/completions", json=completion_body(700)))
            sent = lambda legs: legs["prefill"] >= 1 and legs["decode"] >= 1  # noqa: E731
            await asyncio.to_thread(wait_until, legs_in_flight, "both legs sent", 20, 0.1, until=sent)
            stack.kill("prefill")
            return await call

    start = time.monotonic()
    resp = asyncio.run(run())
    assert time.monotonic() - start < DEADLINES["total_s"]
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Kvferry-Recomputed"].startswith("prefill_")
    assert resp.json()["choices"][0]["token_ids"] == reference["len700"]["token_ids"]
    # With P gone for good, later requests still end: recomputed on D, never stuck.
    again = httpx.post(stack.url + "/v1/completions", json=completion_body(5), timeout=60)
    assert (
        again.status_code == 200 and again.json()["choices"][0]["token_ids"] == reference["len5"]["token_ids"]
    )
