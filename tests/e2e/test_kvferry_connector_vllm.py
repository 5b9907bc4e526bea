"""KvferryConnector inside two real vLLM-CPU servers (P and D) on loopback, no router: requests carry
the contract's kvferry params directly (docs/contracts.md §1). Greedy outputs equal a single instance,
D received the KV over NIXL (its kvferry metrics count it, it computed at most one token per request),
a request with a malformed kvferry block or a duplicate key fails alone while the engine keeps serving,
and a failed transfer reaches a router's client as a recomputed answer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from kvferry.contracts.promtext import metric_sum
from kvferry.tools.pdclient import completion_body, kvferry_legs
from kvferry.tools.pdstack import PdStack, RouterProcess
from kvferry.tools.serve import VllmProcess, free_port

from tests.waiting import wait_until

# Start-up of three vLLM servers on a shared 2-core box can exceed the suite-wide 600 s timeout.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800), pytest.mark.shared_stack("kvferry")]
LENGTHS = (5, 129, 700)  # below, just over, and several CPU blocks (128 tokens)


@pytest.fixture
def pd(shared_stack: PdStack) -> dict[str, VllmProcess]:
    """The shared kvferry pair (P on core 0, D on core 1, live and idle), addressed directly."""
    return {"prefill": shared_stack.server("prefill"), "decode": shared_stack.server("decode")}


def legs(pd: dict, length: int, attempt: int = 0) -> tuple[dict, dict, str]:
    p, d = pd["prefill"].spec, pd["decode"].spec
    return kvferry_legs(
        completion_body(length),
        prefill_engine=p.engine_id,
        prefill_side_port=p.side_port,
        decode_engine=d.engine_id,
        attempt=attempt,
    )


async def _pd_request(pd: dict, length: int) -> dict:
    prefill, decode, rid = legs(pd, length)
    headers = {"X-Request-Id": rid}
    async with httpx.AsyncClient(timeout=180) as client:
        p_resp, d_resp = await asyncio.gather(
            client.post(pd["prefill"].url + "/v1/completions", json=prefill, headers=headers),
            client.post(pd["decode"].url + "/v1/completions", json=decode, headers=headers),
        )
    assert p_resp.status_code == 200, p_resp.text[:500]
    assert d_resp.status_code == 200, d_resp.text[:500]
    return d_resp.json()["choices"][0]


def test_greedy_outputs_equal_single_instance_and_kv_came_over_nixl(pd, reference):
    d_before, p_before = pd["decode"].metrics(), pd["prefill"].metrics()
    for length in LENGTHS:
        choice = asyncio.run(_pd_request(pd, length))
        assert choice["token_ids"] == reference[f"len{length}"]["token_ids"], f"prompt of {length} tokens"
    d_after = pd["decode"].metrics()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(d_after, name, **labels) - metric_sum(d_before, name, **labels)

    assert delta("kvferry_transfers_total", role="consumer") == len(LENGTHS)
    assert delta("kvferry_transfer_failures_total") == 0
    # D computed at most the last prompt token of each request itself; the rest arrived as KV.
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") <= len(LENGTHS)
    assert delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") >= sum(LENGTHS) - len(
        LENGTHS
    )
    p_metrics = pd["prefill"].metrics()
    assert metric_sum(p_metrics, "kvferry_transfer_bytes_total") > 0  # producer side reported too
    # P handed each leg over exactly once, and (CPU caches, one-step prefills) right after its forward.
    handoffs = {
        when: metric_sum(p_metrics, "kvferry_prefill_handoffs_total", when=when)
        - metric_sum(p_before, "kvferry_prefill_handoffs_total", when=when)
        for when in ("after_forward", "finished")
    }
    assert sum(handoffs.values()) == len(LENGTHS) and handoffs["after_forward"] >= 1, handoffs


def test_malformed_kvferry_block_fails_that_request_only(pd, reference):
    _, decode, rid = legs(pd, 129)
    del decode["kv_transfer_params"]["kvferry"]["producer"]["port"]
    resp = httpx.post(
        pd["decode"].url + "/v1/completions", json=decode, headers={"X-Request-Id": rid}, timeout=120
    )
    assert resp.status_code >= 400, resp.text[:300]  # kv_load_failure_policy "fail": an error, not a hang
    assert "kvferry.producer.port is missing" in pd["decode"].log_tail(200_000)
    choice = asyncio.run(_pd_request(pd, 129))  # the engine still serves P/D requests
    assert choice["token_ids"] == reference["len129"]["token_ids"]


def _pending(server: VllmProcess) -> float:
    return metric_sum(server.metrics(), "kvferry_pending")


def _settled(pd: dict, timeout_s: float = 60.0) -> dict[str, float]:
    """Every kvferry_pending series of both engines back to 0 (nothing held, nothing waiting)."""
    return wait_until(
        lambda: {role: _pending(pd[role]) for role in ("prefill", "decode")},
        "kvferry_pending 0 on both engines",
        timeout_s,
        0.5,
        until=lambda pending: not any(pending.values()),
    )


def test_a_second_request_with_a_live_kvferry_key_is_refused_and_the_first_is_served(pd, reference):
    """Two decode requests share one key (a replayed kv_transfer_params): the second fails at once
    with a reason; the first still gets exactly its KV; nothing is held afterwards. (Before, the
    second took over the key: the first waited forever and the second decoded on unwritten blocks.)"""
    prefill, decode, rid = legs(pd, 700)
    p_url, d_url = pd["prefill"].url + "/v1/completions", pd["decode"].url + "/v1/completions"

    receiving = lambda: metric_sum(pd["decode"].metrics(), "kvferry_pending", kind="receives")  # noqa: E731
    before = receiving()

    async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            first = asyncio.create_task(client.post(d_url, json=decode, headers={"X-Request-Id": rid}))
            await asyncio.to_thread(  # D's connector holds the first (its key is live)
                wait_until, receiving, "decode to expect the first", 60, 0.1, until=lambda n: n > before
            )
            second = await client.post(d_url, json=decode, headers={"X-Request-Id": rid + "-replay"})
            p = await client.post(p_url, json=prefill, headers={"X-Request-Id": rid})
            return await first, second, p

    first, second, p = asyncio.run(run())
    assert second.status_code >= 500 and "error" in second.json(), second.text[:300]
    assert "duplicate kvferry key" in pd["decode"].log_tail(200_000)
    assert p.status_code == 200 and first.status_code == 200, (p.text[:300], first.text[:300])
    assert first.json()["choices"][0]["token_ids"] == reference["len700"]["token_ids"]
    _settled(pd)


def test_a_transfer_that_fails_reaches_the_client_as_a_recomputed_answer(
    pd, reference, tmp_path, unused_port
):
    """The kvferry connector inside vLLM through the router's failure path: the router names a side
    channel port where nothing listens, so D cannot register with P and its receive fails
    (handshake_failed; kv_load_failure_policy fail: an error event before the first token). The
    client still gets the right answer, recomputed; D holds nothing afterwards."""

    def entry(server: VllmProcess, side_port: int) -> dict:
        spec = server.spec
        return {"url": server.url, "engine_id": spec.engine_id, "side_host": spec.host,
                "side_port": side_port, "tp_size": 1, "revision": ""}  # fmt: skip

    static = {"prefill": [entry(pd["prefill"], unused_port)], "decode": [entry(pd["decode"], 1)]}
    config = {"mode": "kvferry", "model": "tiny", "discovery": {"static": static}}
    router = RouterProcess(config, tmp_path).start()
    failures = lambda: metric_sum(pd["decode"].metrics(), "kvferry_transfer_failures_total")  # noqa: E731
    before = failures()
    try:
        for stream in (False, True):
            resp = httpx.post(router.url + "/v1/completions", json=completion_body(129, stream), timeout=120)
            assert resp.status_code == 200, resp.text[:300]
            assert resp.headers["X-Kvferry-Recomputed"] == "decode_error_event"
            ids = (
                [t for line in resp.text.splitlines() if line.startswith("data: {")
                 for c in json.loads(line[6:]).get("choices", []) for t in c.get("token_ids") or []]
                if stream else resp.json()["choices"][0]["token_ids"]
            )  # fmt: skip
            assert ids == reference["len129"]["token_ids"]
    finally:
        router.stop()
    assert failures() - before == 2
    assert (
        metric_sum(pd["decode"].metrics(), "kvferry_transfer_failures_total", reason="handshake_failed") >= 2
    )
    # (P holds the two prefills until their lease: D never came)
    wait_until(lambda: _pending(pd["decode"]), "decode to hold nothing", 30, 0.5, until=lambda n: n == 0)


@pytest.fixture
def unused_port() -> int:
    return free_port()
