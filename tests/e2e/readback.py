"""Shared by the KV read-back e2e tests: the single-instance reference, one P/D request sent straight
to the two engines, decode's landed KV compared with prefill's, and the tie-aware output check."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from kvferry.tools.pdclient import completion_body, kvferry_legs, top2_gaps


def reference(url: str, lengths: Iterable[int], timeout_s: float) -> dict[int, tuple[list[int], list[float]]]:
    """Greedy token ids and top-2 logprob gaps of each prompt length, one request at a time."""
    out = {}
    with httpx.Client(timeout=timeout_s) as client:
        for n in lengths:
            resp = client.post(url + "/v1/completions", json={**completion_body(n), "logprobs": 2})
            assert resp.status_code == 200, resp.text[:300]
            choice = resp.json()["choices"][0]
            out[n] = (choice["token_ids"], top2_gaps(choice))
    return out


async def pd_request(client: httpx.AsyncClient, stack: dict[str, Any], n: int) -> tuple[str, list[int]]:
    """(request id, decode's token ids) of one P/D request, both legs sent at once."""
    p, d = stack["prefill"].spec, stack["decode"].spec
    prefill, decode, rid = kvferry_legs(
        completion_body(n),
        prefill_engine=p.engine_id,
        prefill_side_port=p.side_port,
        decode_engine=d.engine_id,
    )
    headers = {"X-Request-Id": rid}
    p_resp, d_resp = await asyncio.gather(
        client.post(stack["prefill"].url + "/v1/completions", json=prefill, headers=headers),
        client.post(stack["decode"].url + "/v1/completions", json=decode, headers=headers),
    )
    assert p_resp.status_code == 200, p_resp.text[:300]
    assert d_resp.status_code == 200, d_resp.text[:300]
    return rid, d_resp.json()["choices"][0]["token_ids"]


def kv_equal(dumps: Path, rid: str, n: int) -> int:
    """Decode's blocks hold prefill's values element by element (kv_dump_dir); the bytes compared."""
    prod = np.load(dumps / f"{rid}-0-producer-h0.npy")
    cons = np.load(dumps / f"{rid}-0-consumer-h0.npy")
    assert cons.shape[3] >= n - 1 and prod.shape[3] >= cons.shape[3], (prod.shape, cons.shape)
    tokens = cons.shape[3]
    diff = np.argwhere((prod[:, :, :, :tokens] != cons).any(axis=-1))
    assert diff.size == 0, f"{n} tokens: KV differs at (layer, plane, head, token, dim) {diff[:5].tolist()}"
    return int(cons.size)


def parting(what: str, got: list[int], want: list[int], gaps: list[float], tie: float) -> str | None:
    """None when `got` equals the reference; where it parts when that is at a reference tie (the
    top-2 logprobs closer than the dtype resolves); fails otherwise."""
    if got == want:
        return None
    at = next(i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
    assert len(got) == len(want) and gaps[at] <= tie, (
        f"{what}: token {at} is {got[at]}, single {want[at]} (top-2 gap {gaps[at]:.1e})"
    )
    return f"{what} at {at} (gap {gaps[at]:.1e})"
