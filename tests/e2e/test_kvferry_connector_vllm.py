"""KvferryConnector inside two real vLLM-CPU servers (P and D) on loopback, no router: requests carry
the contract's kvferry params directly (docs/contracts.md §1). Greedy outputs equal a single instance,
D received the KV over NIXL (its kvferry metrics count it, it computed at most one token per request),
and a request with a malformed kvferry block fails alone while the engine keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvferry.connector.promtext import metric_sum
from kvferry.connector.serve import ServerSpec, VllmProcess, free_port

from .pdclient import completion_body, kvferry_legs

# Start-up of three vLLM servers on a shared 2-core box can exceed the suite-wide 600 s timeout.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
LENGTHS = (5, 129, 700)  # below, just over, and several CPU blocks (128 tokens)
EXTRA = {"backends": ["UCX"], "deadline_s": 60.0}
READY_S = 600  # vLLM-CPU starts in ~30 s alone, several minutes when the 2 cores are shared


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Greedy token ids of one plain vLLM instance for LENGTHS; stopped before P and D start (memory).
    Own fixture (not conftest's) for a start-up bound that survives a busy shared machine."""
    spec = ServerSpec(model=tiny_model, port=free_port(), cores="0-1")
    server = VllmProcess(spec, tmp_path_factory.mktemp("kvferry-single") / "single.log").start()
    try:
        server.wait_ready(READY_S)
        out = {}
        for n in LENGTHS:
            resp = httpx.post(server.url + "/v1/completions", json=completion_body(n), timeout=180)
            assert resp.status_code == 200, resp.text[:300]
            out[f"len{n}"] = {"token_ids": resp.json()["choices"][0]["token_ids"]}
        return out
    finally:
        server.stop()


@pytest.fixture(scope="module", params=[(None, None), (128, 64)], ids=["same-blocks", "P128-D64"])
def pd(
    request: pytest.FixtureRequest, tiny_model: Path, reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    """P on core 0, D on core 1, both with KvferryConnector (same block size: prepped descriptor lists;
    P 128 / D 64 tokens: per-request coalesced mapping); stopped by PID (process group)."""
    blocks = dict(zip(("prefill", "decode"), request.param, strict=True))
    logs = tmp_path_factory.mktemp("kvferry-pd")
    servers = {
        role: VllmProcess(
            ServerSpec(
                model=tiny_model,
                port=free_port(),
                role=role,
                connector="KvferryConnector",
                engine_id=f"{role}-0",
                side_port=free_port(),
                cores=cores,
                block_size=blocks[role],
                connector_extra=dict(EXTRA),
            ),
            logs / f"{role}.log",
        )
        for role, cores in (("prefill", "0"), ("decode", "1"))
    }
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready(READY_S)
            server.pin()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


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
