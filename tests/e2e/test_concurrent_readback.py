"""KV read back and greedy equality with many requests in flight, sliding-window models among them.

The read-back matrix (test_kv_readback_matrix.py) sends one request at a time; here a whole batch of
prompts of mixed lengths (across window and block boundaries, some long enough to be prefilled in
chunks) is in flight at once through a real vLLM-CPU prefill and decode running the kvferry connector
with `kv_dump_dir`. For every request:

- decode's blocks hold exactly prefill's KV, value by value, for every layer, plane, head, token and
  dim a layer still attends to (a windowed layer's older tokens read as zeros on both sides);
- greedy outputs equal the single instance's (decode itself, asked first, one request at a time),
  ties aside (the reference's top-2 logprobs closer than the dtype resolves).

Shapes: Mistral with a window on every layer (bfloat16) and a Llama with windowed layers
interleaved with full ones, Gemma-3's way (two KV-cache groups, float32); full-attention shapes get
the same concurrent batch in test_kv_readback_matrix.py. With a window, prefill computes all but the
prompt's last token and decode that one (connector/scheduler.py): the batch includes the lengths
where a whole-prompt load would have read the first window token from vLLM's shared null block
(n = window + k * block - 1).
One case keeps decode's prefix cache on, so decode holds most of each prompt and receives the rest.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from kvferry.local.tinymodel import SHAPES, ensure
from kvferry.router.promtext import metric_sum
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

from .pdclient import completion_body, kvferry_legs, top2_gaps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
READY_S = 600
TIE = {"float32": 1e-4, "bfloat16": 2**-8}
# window 64, blocks 32..128: 127 and 191 are the lengths whose last token's window started in a
# nulled block; 2049 is prefilled in chunks (max_num_batched_tokens below)
LENGTHS = (31, 63, 64, 65, 126, 127, 128, 159, 191, 192, 255, 700, 2049)
CHUNK_TOKENS = 512
CASES = {  # id: (shape, prefill block, decode block, decode prefix cache)
    "mistral-w64-bf16-P64-D64": ("mistral-h8kv2d128l4w64-bf16", 64, 64, False),
    "llama-w64f2-f32-P32-D64-prefix": ("llama-h4kv2d64l4w64f2-f32", 32, 64, True),
}
# KVFERRY_MATRIX=full: every block pair the report named, for both windowed models (~3 min a case)
PAIRS = ((64, 64), (64, 128), (128, 64), (32, 64), (128, 128), (128, 32))
FULL = {
    f"{tag}-P{p}-D{d}": (shape, p, d, False)
    for tag, shape in (
        ("mistral-w64-bf16", "mistral-h8kv2d128l4w64-bf16"),
        ("llama-w64f2-f32", "llama-h4kv2d64l4w64f2-f32"),
    )
    for p, d in PAIRS
} | {"mistral-w48-f32-P32-D64-prefix": ("mistral-h4kv1d64l3w48-f32", 32, 64, True)}
if os.environ.get("KVFERRY_MATRIX") == "full":
    CASES |= {k: v for k, v in FULL.items() if k not in CASES}


@pytest.fixture(scope="module", params=list(CASES.values()), ids=list(CASES))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """P on core 0 and D on core 1; D is also the single-instance reference (asked first)."""
    name, p_block, d_block, prefix = request.param
    arch, shape = SHAPES[name]
    model = ensure(arch, shape)
    work = tmp_path_factory.mktemp(name)
    dumps = work / "kv"
    dumps.mkdir()
    extra = {"backends": ["UCX"], "deadline_s": 120.0, "kv_dump_dir": str(dumps)}

    def spec(role: str, block: int, cores: str, caching: bool) -> ServerSpec:
        return ServerSpec(
            model=model,
            port=free_port(),
            role=role,
            connector="KvferryConnector",
            engine_id=f"{role}-0",
            side_port=free_port(),
            cores=cores,
            block_size=block,
            dtype=shape.dtype,
            max_model_len=4096,
            connector_extra=dict(extra),
            prefix_caching=caching,
            extra_args=["--max-num-batched-tokens", str(CHUNK_TOKENS), "--max-num-seqs", "16"],
        )

    servers = {
        "prefill": VllmProcess(spec("prefill", p_block, "0", False), work / "prefill.log"),
        "decode": VllmProcess(spec("decode", d_block, "1", prefix), work / "decode.log"),
    }
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(READY_S)
        yield {**servers, "dumps": dumps, "name": name, "tie": TIE[shape.dtype], "prefix": prefix}
    finally:
        for s in servers.values():
            s.stop()


def _reference(url: str) -> dict[int, tuple[list[int], list[float]]]:
    out = {}
    with httpx.Client(timeout=300) as client:
        for n in LENGTHS:
            resp = client.post(url + "/v1/completions", json={**completion_body(n), "logprobs": 2})
            assert resp.status_code == 200, resp.text[:300]
            choice = resp.json()["choices"][0]
            out[n] = (choice["token_ids"], top2_gaps(choice))
    return out


async def _pd_batch(stack: dict) -> dict[int, tuple[str, list[int]]]:
    """Every length at once: all prefill and decode legs in flight together."""
    p, d = stack["prefill"].spec, stack["decode"].spec
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(n: int) -> tuple[int, str, list[int]]:
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
            return n, rid, d_resp.json()["choices"][0]["token_ids"]

        done = await asyncio.gather(*(one(n) for n in LENGTHS))
    return {n: (rid, ids) for n, rid, ids in done}


def _kv_equal(stack: dict, rid: str, n: int) -> int:
    """Decode's landed KV equals prefill's handed-over KV; returns the bytes compared (0: no transfer)."""
    cons_path = stack["dumps"] / f"{rid}-0-consumer-h0.npy"
    if stack["prefix"] and not cons_path.exists():
        return 0  # decode's own prefix cache held all it needed: nothing was pushed
    prod = np.load(stack["dumps"] / f"{rid}-0-producer-h0.npy")
    cons = np.load(cons_path)
    assert cons.shape[3] >= n - 1 and prod.shape[3] >= cons.shape[3], (prod.shape, cons.shape)
    tokens = cons.shape[3]
    diff = np.argwhere((prod[:, :, :, :tokens] != cons).any(axis=-1))
    assert diff.size == 0, f"{n} tokens: KV differs at (layer, plane, head, token, dim) {diff[:5].tolist()}"
    return int(cons.size)


def test_concurrent_batch_kv_and_outputs_equal_single(stack, capsys):
    reference = _reference(stack["decode"].url)  # one at a time, nothing transferred yet
    before = stack["decode"].metrics()
    got = asyncio.run(_pd_batch(stack))
    compared, parted = 0, []
    for n in LENGTHS:
        rid, ids = got[n]
        compared += _kv_equal(stack, rid, n)
        want, gaps = reference[n]
        if ids != want:
            at = next(i for i, (a, b) in enumerate(zip(want, ids, strict=False)) if a != b)
            assert len(ids) == len(want) and gaps[at] <= stack["tie"], (
                f"{stack['name']} {n} tokens: token {at} is {ids[at]}, single {want[at]} "
                f"(top-2 gap {gaps[at]:.1e})"
            )
            parted.append(f"{n} tokens at {at} (gap {gaps[at]:.1e})")
    after = stack["decode"].metrics()
    assert metric_sum(after, "kvferry_transfer_failures_total") == 0
    received = metric_sum(after, "kvferry_transfers_total", role="consumer") - metric_sum(
        before, "kvferry_transfers_total", role="consumer"
    )
    assert received == len(LENGTHS) or (stack["prefix"] and 0 < received <= len(LENGTHS)), received
    with capsys.disabled():
        print(
            f"\n{stack['name']}: {len(LENGTHS)} requests at once, {received} pushed, "
            f"{compared} KV bytes compared, ties used: {parted or 0}"
        )
