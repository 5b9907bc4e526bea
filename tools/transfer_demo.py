"""`kvferry transfer-demo`: a real two-sided push transfer over NIXL between processes on this machine.

Both sides hold vLLM-CPU KV caches built and written by vLLM's own kernel (`vec` ISA: K dim-major
inside a block), layouts measured as the connector measures them inside vLLM. Prefill (producer)
TP=1 with 32-token blocks; decode (consumer) TP=2 with 128-token blocks, one process per rank.
Decode registers first, prefill finishes second (and the reverse for a second request); every
consumer rank then reads the KV through its own layout and compares it with the producer's values
for every element, and its pages with what its own vLLM write of the same KV stores.
"""

from __future__ import annotations

import argparse
import time

from kvferry.tools.hostkv import CacheShape
from kvferry.tools.rankproc import RankProcess, RankSpec

P_BLOCK, D_BLOCK = 32, 128


def run(tokens: int, backend: str, out=print) -> bool:
    model = dict(layers=2, heads=4, head_dim=64, order="cpu/vec", dtype="bfloat16")
    p_shape = CacheShape(block_size=P_BLOCK, tp_size=1, num_blocks=-(-tokens // P_BLOCK) * 2 + 4, **model)
    d_shape = CacheShape(block_size=D_BLOCK, tp_size=2, num_blocks=-(-tokens // D_BLOCK) * 2 + 4, **model)
    extra = {"backends": [backend]}
    procs: list[RankProcess] = []
    try:
        prod = RankProcess(RankSpec("producer", "prefill-0", 0, p_shape, extra))
        procs.append(prod)
        cons = [RankProcess(RankSpec("consumer", "decode-0", r, d_shape, extra)) for r in range(2)]
        procs += cons
        out(f"started prefill-0 (TP1, block {P_BLOCK}) pid {prod.pid}, side channel :{prod.port}")
        out(f"started decode-0 (TP2, block {D_BLOCK}) pids {[c.pid for c in cons]}")
        out(f"prefill layout: {prod.call('layout')}")
        out(f"decode layout (rank 0): {cons[0].call('layout')}")
        ok = True
        for n, (req, d_first) in enumerate([("req-a", True), ("req-b", False)]):
            p_need, d_need = -(-tokens // P_BLOCK), -(-tokens // D_BLOCK)
            p_blocks = list(range(2 + n * p_need, 2 + (n + 1) * p_need))
            d_blocks = list(range(2 + n * d_need, 2 + (n + 1) * d_need))[::-1]  # any order works
            ok &= _one(req, tokens, prod, cons, p_blocks, d_blocks, d_first, out)
        out(_metric_lines(prod.call("metrics"), "kvferry_transfer_bytes_total", "kvferry_descriptors_per"))
        return ok
    finally:
        for p in procs:
            p.stop()


def _one(req, tokens, prod, cons, p_blocks, d_blocks, d_first, out) -> bool:
    expect = dict(
        producer_engine="prefill-0",
        producer_host="127.0.0.1",
        producer_port=prod.port,
        producer_tp=1,
        block_ids=[d_blocks],
        num_tokens=tokens,
        deadline_s=30.0,
    )
    t0 = time.perf_counter()
    if d_first:
        for c in cons:
            c.call("expect", req, 0, expect)
    handoff = prod.call("finish", req, 0, p_blocks, tokens, "decode-0")
    if not d_first:
        for c in cons:
            c.call("expect", req, 0, expect)
    results = [c.call("results", 30.0, 1) for c in cons]
    elapsed = time.perf_counter() - t0
    sent = prod.call("results", 10.0, 1)
    order = "registration first" if d_first else "prefill finished first"
    out(
        f"{req}: {tokens} tokens, {order}: producer hand-off {handoff * 1e6:.0f} us, "
        f"received on {sum(bool(r['received']) for r in results)}/2 decode ranks in {elapsed * 1e3:.1f} ms, "
        f"producer released blocks: {sent['sent'] or sent['released']}"
    )
    bad = [c.call("mismatches", d_blocks, tokens) for c in cons]
    out(f"{req}: values differing from the producer's, per decode rank (own layout): {bad}")
    return all(r["received"] for r in results) and not any(bad)


def _metric_lines(text: str, *prefixes: str) -> str:
    keep = [line for line in text.splitlines() if line.startswith(prefixes) and not line.endswith(" 0.0")]
    return "producer metrics:\n  " + "\n  ".join(keep[:8])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry transfer-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length to transfer")
    parser.add_argument("--backend", default="UCX", choices=["UCX", "LIBFABRIC"], help="NIXL backend")
    args = parser.parse_args(argv)
    ok = run(args.tokens, args.backend)
    print("DEMO OK: decode KV equals prefill KV for every element of every layer" if ok else "DEMO FAILED")
    return 0 if ok else 1
