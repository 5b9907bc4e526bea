"""Greedy outputs through router -> prefill + decode equal a single vLLM instance, token for token,
for every connector mode that exists, and decode really received the KV (it did not recompute)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvferry.connector.pdstack import PdStack, kvferry_connector_available
from kvferry.connector.promtext import metric_sum, parse_metrics

from .pdclient import PROMPT_LENGTHS, outputs, requests

# Setup starts vLLM servers: on a shared 2-core host that alone can take minutes.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

# (mode, prefill block size, decode block size); kvferry cases join once its connector exists.
CASES = [("vllm-pull", None, None), ("vllm-push", None, None)]
if kvferry_connector_available():
    CASES += [
        ("kvferry", None, None),
        # Known bug (issue 4): only the 128-token prompt diverges, after 7 equal tokens: exactly one
        # producer block (128) landing in two consumer blocks (64). Ruled out (2026-11-30): block size
        # itself (single instances at 64 and 128 agree on every prompt) and the NIXL mapping (tests/nixl
        # moves 127 and 128 tokens 128 -> 64 exactly). Prompt sweep (same day): P128/D64 fails at 128
        # and 384 tokens (an odd number of full producer blocks), passes at 64/192/256/320; P64/D64 and
        # P128/D128 pass at all six. So it is in the vLLM glue for mixed block sizes.
        pytest.param(
            ("kvferry", 128, 64),
            marks=pytest.mark.xfail(reason="128-token prompt diverges at P128/D64: known bug, issue 4"),
        ),
    ]


def _case_id(case: tuple[str, int | None, int | None]) -> str:
    mode, pb, db = case
    return mode if pb is None else f"{mode}-P{pb}-D{db}"


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def stack(
    request: pytest.FixtureRequest, reference: Any, tiny_model: Path, tmp_path_factory: Any
) -> Iterator[PdStack]:
    mode, pb, db = request.param
    workdir = tmp_path_factory.mktemp(_case_id(request.param))
    deadlines = {"prefill_s": 60, "decode_first_token_s": 60, "transfer_s": 10, "total_s": 120}
    pd = PdStack(mode, tiny_model, workdir, prefill_block_size=pb, decode_block_size=db, deadlines=deadlines)
    pd.start()
    try:
        yield pd
    finally:
        pd.stop()


def test_outputs_equal_single_instance_and_decode_received_kv(
    stack: PdStack, reference: dict[str, Any]
) -> None:
    assert stack.decode is not None and stack.prefill is not None
    d_before, p_before = stack.decode.metrics(), stack.prefill.metrics()

    got = outputs(stack.url, concurrency=4)

    for key, want in reference.items():
        assert got[key] == want, f"{key}: P/D output differs from the single instance"
    d_after, p_after = stack.decode.metrics(), stack.prefill.metrics()
    n = len(requests())

    def delta(after: dict[str, float], before: dict[str, float], name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    external = delta(d_after, d_before, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = delta(d_after, d_before, "vllm:prompt_tokens_by_source_total", source="local_compute")
    prompt = delta(d_after, d_before, "vllm:prompt_tokens_total")
    router = parse_metrics(httpx.get(stack.url + "/metrics").text)
    recomputed = metric_sum(router, "kvferry_router_recomputes_total")
    assert metric_sum(router, "kvferry_router_requests_total", outcome="ok") >= n
    assert local <= n, f"decode computed {local} prompt tokens locally: it recomputed instead of loading KV"
    if stack.mode == "vllm-push" and recomputed:
        # Upstream NixlPushConnector wedges silently under concurrency: D waits for a write that never
        # comes (shared/reference/upstream-sweep.md). The router's transfer deadline turns each such
        # request into a counted recompute; the outputs above are still exact, and most KV still moved.
        assert recomputed < n, f"upstream push delivered no KV at all ({recomputed} recomputes)"
        return
    # D computed (almost) nothing itself: every prompt token but at most one per request came over NIXL.
    assert prompt >= sum(PROMPT_LENGTHS), prompt
    assert external >= prompt - n, (external, prompt)
    # P ran exactly the 1-token prefill legs.
    assert delta(p_after, p_before, "vllm:generation_tokens_total") == n
    assert recomputed == 0
