"""Prefix-aware routing through the router's HTTP path (stand-in engines: the router's own choices):
a repeated prefix goes to the decode that holds it, a short prompt to decode alone, and the routing
section of router.yaml is validated with errors that name the key."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvferry.contracts.promtext import parse_metrics
from kvferry.router.app import STATE, build_app
from kvferry.router.config import ConfigError, parse_config

from tests.unit.router.engines import FakeEngine

ROUTING = {
    "block_tokens": 16,
    "disaggregation": {"rule": "selective", "min_prefill_tokens": 64, "decode_hit_fraction": 0.8},
}


def _config(p: FakeEngine, decodes: list[FakeEngine], routing: dict[str, Any]) -> dict[str, Any]:
    def entry(e: FakeEngine, port: int) -> dict[str, Any]:
        return {"url": e.url, "engine_id": e.name, "side_host": "127.0.0.1", "side_port": port}

    return {
        "mode": "kvferry", "model": "tiny", "routing": routing,
        "discovery": {"static": {"prefill": [entry(p, 5600)],
                                 "decode": [entry(d, 5601 + i) for i, d in enumerate(decodes)]}},
    }  # fmt: skip


async def _served(client: TestClient) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    return {k: v for k, v in parse_metrics(text).items() if k.startswith("kvferry_router_") and v}


def test_repeated_prefix_goes_to_its_holder_and_short_prompts_to_decode_alone() -> None:
    async def main() -> None:
        p, d0, d1 = FakeEngine("prefill-0"), FakeEngine("decode-0"), FakeEngine("decode-1")
        for e in (p, d0, d1):
            await e.server.start_server()
        client = TestClient(TestServer(build_app(parse_config(_config(p, [d0, d1], ROUTING)))))
        await client.start_server()
        tracker = client.server.app[STATE].tracker
        endpoints = {e.engine_id: e for e in client.server.app[STATE].discovery.current().decode}

        async def send(prompt: list[int]) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 3}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200, await resp.text()

        try:
            history = list(range(1000, 1256))  # 16 blocks
            tracker.observe(endpoints["decode-0"], waiting=1, kv_usage=0)  # steer turn 1 to decode-1
            await send(history)
            assert (len(p.seen), len(d0.seen), len(d1.seen)) == (1, 0, 1)
            assert "kv_transfer_params" in d1.seen[0]["body"]  # 256 tokens lacking: P/D
            tracker.observe(endpoints["decode-0"], waiting=0, kv_usage=0)  # now a load tie
            await send([*history, *range(7, 47)])  # next turn: decode-1 holds 256 of 296 tokens
            assert (len(p.seen), len(d0.seen), len(d1.seen)) == (1, 0, 2)
            assert "kv_transfer_params" not in d1.seen[1]["body"]  # decode alone, no prefill leg
            await send(list(range(5000, 5256)))  # an unrelated prompt: load alone (the tie) decides
            assert (len(p.seen), len(d0.seen), len(d1.seen)) == (2, 1, 2)
            await send(list(range(30)))  # short: decode alone
            assert len(p.seen) == 2 and "kv_transfer_params" not in (d0.seen + d1.seen)[-1]["body"]
            m = await _served(client)
            assert m['kvferry_router_served_total{path="pd",reason="prefill_pays"}'] == 2
            assert m['kvferry_router_served_total{path="decode_only",reason="decode_holds_prefix"}'] == 1
            assert m['kvferry_router_served_total{path="decode_only",reason="short_prompt"}'] == 1
            assert m['kvferry_router_prefix_hit_tokens_total{role="decode"}'] == 256
            assert m['kvferry_router_prompt_tokens_total{role="decode"}'] == 256 + 296 + 256 + 30
            assert m['kvferry_router_prompt_tokens_total{role="prefill"}'] == 256 + 256
        finally:
            await client.close()
            for e in (p, d0, d1):
                await e.server.close()

    asyncio.run(main())


def test_a_hot_prefix_spreads_past_the_load_bound() -> None:
    async def main() -> None:
        p, d0, d1 = FakeEngine("prefill-0"), FakeEngine("decode-0"), FakeEngine("decode-1")
        for e in (p, d0, d1):
            await e.server.start_server()
        routing = {"block_tokens": 16, "load_bound": 1}
        client = TestClient(TestServer(build_app(parse_config(_config(p, [d0, d1], routing)))))
        await client.start_server()
        tracker = client.server.app[STATE].tracker
        endpoints = {e.engine_id: e for e in client.server.app[STATE].discovery.current().decode}
        body = {"model": "tiny", "prompt": list(range(64)), "max_tokens": 3}
        try:
            assert (await client.post("/v1/completions", json=body)).status == 200
            assert len(d0.seen) == 1  # the tie goes to decode-0, which now holds the prefix
            tracker.observe(endpoints["decode-0"], waiting=1, kv_usage=0)  # within the bound of 1
            assert (await client.post("/v1/completions", json=body)).status == 200
            assert (len(d0.seen), len(d1.seen)) == (2, 0)
            tracker.observe(endpoints["decode-0"], waiting=2, kv_usage=0)  # past it
            assert (await client.post("/v1/completions", json=body)).status == 200
            assert (len(d0.seen), len(d1.seen)) == (2, 1)
        finally:
            await client.close()
            for e in (p, d0, d1):
                await e.server.close()

    asyncio.run(main())


def _parse(routing: Any, policy: str = "least-loaded") -> Any:
    engine = {"url": "http://127.0.0.1:1", "engine_id": "e", "side_host": "h", "side_port": 1}
    static = {"prefill": [engine], "decode": [{**engine, "engine_id": "f"}]}
    return parse_config(
        {"mode": "kvferry", "policy": policy, "routing": routing, "discovery": {"static": static}}
    )


@pytest.mark.parametrize(
    ("routing", "policy", "message"),
    [
        ({"disaggregation": {"rule": "sometimes"}}, "least-loaded",
         "routing.disaggregation.rule: 'sometimes' is not one of ['always', 'selective']"),
        ({"disaggregation": {"decode_hit_fraction": 1.5}}, "least-loaded",
         "routing.disaggregation.decode_hit_fraction: expected a number from 0 to 1, got 1.5"),
        ({"disaggregation": {"min_prefill_tokens": -1}}, "least-loaded",
         "routing.disaggregation.min_prefill_tokens: expected a non-negative integer, got -1"),
        ({"load_bound": -1}, "least-loaded", "routing.load_bound: expected a non-negative number, got -1"),
        ({"block_tokens": 0}, "least-loaded", "routing.block_tokens: expected a positive number, got 0"),
        ({"prefix": True}, "least-loaded", "routing: unknown key(s) ['prefix']"),
        ({"prefix_aware": True}, "round-robin", "routing.prefix_aware: needs policy least-loaded"),
    ],
)  # fmt: skip
def test_routing_config_errors_name_the_key(routing: Any, policy: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _parse(routing, policy)
    assert str(err.value).startswith(message)


def test_prefix_awareness_defaults_to_the_policy() -> None:
    assert _parse({}).routing.prefix_aware is True
    assert _parse({}, "round-robin").routing.prefix_aware is False
    assert _parse({"prefix_aware": False}).routing.prefix_aware is False
    assert _parse({}).routing.disaggregation.rule == "always"
