"""Transfer benchmark: kvferry's push path vs raw NIXL, side by side in one run, printed as ratios.

Between processes on this machine (real NIXL, UCX, DRAM):
  1. producer main-thread time per request (the hand-off only),
  2. descriptors and preparation time per request for 1k/4k/16k-token KV: units (no coalescing),
     coalesced (per request) and prepped (lists reused across requests, same layout on both sides),
  3. WRITE throughput of the connector path vs one raw NIXL WRITE of the same bytes,
  4. idle CPU of an endpoint (no UCX progress thread) vs the same endpoint with the progress thread
     that vLLM's hard-coded NIXL config enables.

    python bench/transfer_bench.py [--reps 5] [--sizes 1024 4096 16384]

Numbers are for this machine only; no assertion is made on them.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np
from kvferry.tools.hostkv import CacheShape
from kvferry.tools.rankproc import RankProcess, RankSpec

# A small model per token: 4 layers x 2 planes x 8 heads x 64 dims x 4 B = 16 KiB per token.
MODEL = dict(layers=4, heads=8, head_dim=64)


def _pair(
    p_shape: CacheShape, d_shape: CacheShape, mode: str, procs: list
) -> tuple[RankProcess, RankProcess]:
    prod = RankProcess(RankSpec("producer", "prefill-0", 0, p_shape, {"descriptors": mode}))
    procs.append(prod)
    cons = RankProcess(RankSpec("consumer", "decode-0", 0, d_shape, {}))
    procs.append(cons)
    return prod, cons


def _requests(prod, cons, tokens: int, reps: int, p_bs: int, d_bs: int) -> tuple[list[float], list[dict]]:
    handoffs = []
    p_blocks, d_blocks = list(range(-(-tokens // p_bs))), list(range(-(-tokens // d_bs)))
    for i in range(-1, reps):  # request -1 warms up (peer load, first-touch of pages) and is dropped
        cons.call(
            "expect",
            f"{tokens}-r{i}",
            0,
            dict(
                producer_engine="prefill-0",
                producer_host="127.0.0.1",
                producer_port=prod.port,
                producer_tp=1,
                block_ids=[d_blocks],
                num_tokens=tokens,
                deadline_s=60.0,
            ),
        )
        handoff = prod.call("finish", f"{tokens}-r{i}", 0, p_blocks, tokens, "decode-0", False)
        got = cons.call("results", 60.0, 1, timeout_s=90)
        if not got["received"]:
            raise RuntimeError(f"transfer {i} of {tokens} tokens failed: {got}")
        prod.call("results", 10.0, 1)
        if i < 0:
            prod.call("writes")  # drop the warm-up record
        else:
            handoffs.append(handoff)
    return handoffs, prod.call("writes")


def descriptor_table(sizes: list[int], reps: int) -> dict:
    rows: dict = {}
    procs: list[RankProcess] = []
    top = max(sizes)
    try:
        cases = [
            ("units", 16, 32),
            ("coalesced", 16, 32),  # different block sizes: per-request lists
            ("units", 16, 16),
            ("coalesced", 16, 16),
            ("prepped", 16, 16),  # same layout on both sides
        ]
        for mode, p_bs, d_bs in cases:
            p_shape = CacheShape(block_size=p_bs, num_blocks=top // p_bs + 1, **MODEL)
            d_shape = CacheShape(block_size=d_bs, num_blocks=top // d_bs + 1, **MODEL)
            prod, cons = _pair(p_shape, d_shape, mode, procs)
            for tokens in sizes:
                handoffs, writes = _requests(prod, cons, tokens, reps, p_bs, d_bs)
                rows[(mode, p_bs, d_bs, tokens)] = dict(
                    handoff_us=statistics.median(handoffs) * 1e6,
                    descriptors=writes[-1]["descriptors"],
                    prep_ms=statistics.median(w["prep_s"] for w in writes) * 1e3,
                    write_ms=statistics.median(w["write_s"] for w in writes) * 1e3,
                    nbytes=writes[-1]["nbytes"],
                )
            for p in (prod, cons):
                p.stop()
    finally:
        for p in procs:
            p.stop()
    return rows


# ---- raw NIXL baseline: one descriptor, one WRITE, same bytes ----
def _raw_target(conn, nbytes: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("raw-target", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = np.zeros(nbytes, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    while not conn.poll(0.001):
        agent.get_new_notifs()  # progress, as the connector's consumer does
    conn.recv()


def raw_write_ms(nbytes: int, reps: int) -> float:
    from nixl._api import nixl_agent, nixl_agent_config

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = ctx.Process(target=_raw_target, args=(child, nbytes))
    target.start()
    try:
        if not parent.poll(60):
            raise TimeoutError("raw target did not start")
        meta, remote_addr = parent.recv()
        agent = nixl_agent("raw-init", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        src = np.ones(nbytes, dtype=np.uint8)
        agent.register_memory([(src.ctypes.data, nbytes, 0, "")], "DRAM")
        peer = agent.add_remote_agent(meta)
        local = agent.get_xfer_descs([(src.ctypes.data, nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM")
        times = []
        for _ in range(reps + 1):  # the first one connects and is dropped
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("WRITE", local, remote, peer, b"done")
            state = agent.transfer(handle)
            deadline = t0 + 60
            while state == "PROC" and time.perf_counter() < deadline:
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw WRITE ended in state {state}")
        return statistics.median(times[1:]) * 1e3
    finally:
        parent.send("stop")
        target.join(10)
        if target.is_alive():
            target.kill()
            target.join(5)


# ---- idle CPU ----
def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(seconds: float) -> dict[str, float]:
    out = {}
    for label, extra in (
        ("kvferry (no progress thread)", {}),
        ("with UCX progress thread", {"progress_thread": True}),
    ):
        proc = RankProcess(RankSpec("producer", "idle-0", 0, CacheShape(), extra))
        try:
            time.sleep(1.0)  # let start-up settle
            c0, t0 = _cpu_seconds(proc.pid), time.monotonic()
            time.sleep(seconds)
            out[label] = (_cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0) * 100
        finally:
            proc.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)

    rows = descriptor_table(args.sizes, args.reps)
    print("\n== per request: descriptors, preparation and WRITE time (median of", args.reps, "reps) ==")
    print(
        f"{'mode':<10} {'P/D block':>9} {'tokens':>6} {'MiB':>6} {'descs':>7} {'prep ms':>8} {'write ms':>9} "
        f"{'hand-off us':>11}"
    )
    for (mode, p_bs, d_bs, tokens), r in rows.items():
        print(
            f"{mode:<10} {f'{p_bs}/{d_bs}':>9} {tokens:>6} {r['nbytes'] / 2**20:>6.1f} {r['descriptors']:>7} "
            f"{r['prep_ms']:>8.2f} {r['write_ms']:>9.2f} {r['handoff_us']:>11.1f}"
        )
    print("\n== coalescing ratios (units / coalesced) ==")
    for p_bs, d_bs in ((16, 32), (16, 16)):
        for tokens in args.sizes:
            u, c = rows[("units", p_bs, d_bs, tokens)], rows[("coalesced", p_bs, d_bs, tokens)]
            descs, prep = u["descriptors"] / c["descriptors"], u["prep_ms"] / c["prep_ms"]
            write = u["write_ms"] / c["write_ms"]
            print(
                f"P/D block {p_bs}/{d_bs}, {tokens:>5} tokens: descriptors {descs:7.1f}x fewer, "
                f"prep {prep:5.1f}x faster, write {write:5.1f}x faster"
            )
    print("\n== connector WRITE vs raw NIXL WRITE of the same bytes (one descriptor) ==")
    for tokens in args.sizes:
        for mode, p_bs, d_bs in (("coalesced", 16, 32), ("prepped", 16, 16)):
            r = rows[(mode, p_bs, d_bs, tokens)]
            raw = raw_write_ms(r["nbytes"], args.reps)
            conn_ms = r["prep_ms"] + r["write_ms"]
            print(
                f"{tokens:>5} tokens {mode:<9} {p_bs}/{d_bs}: connector {conn_ms:7.2f} ms "
                f"({r['nbytes'] / conn_ms / 1e6:5.2f} GB/s) vs raw {raw:7.2f} ms "
                f"({r['nbytes'] / raw / 1e6:5.2f} GB/s): ratio {raw / conn_ms:4.2f}"
            )
    print("\n== producer main thread: hand-off per request ==")
    handoffs = [r["handoff_us"] for r in rows.values()]
    print(f"median {statistics.median(handoffs):.1f} us, max {max(handoffs):.1f} us (any size, any mode)")
    print(f"\n== idle CPU over {args.idle_seconds:.0f} s (one endpoint process, % of one core) ==")
    idle = idle_cpu(args.idle_seconds)
    for label, pct in idle.items():
        print(f"{label:<30} {pct:6.1f} %")
    a, b = idle.values()
    print(f"ratio: the progress thread costs {b / max(a, 0.01):.0f}x the idle CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
