"""GPU check step: the cases, the driver and the one line per case.

`kvferry gpu-check` (or `python -m kvferry.tools.gpucheck`): every CUDA backend page order and KV
dtype on each side, block sizes 16/32 and TP 1->1, 2->1, 1->2, moved through VRAM registration and
then, in a separate pass, through host staging; each case's requests land and are compared on the
device, the WRITE is measured against the CUDA event of the KV write, and throughput is printed next
to a raw one-descriptor NIXL WRITE of the same bytes. Exit status 1 on any difference.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from dataclasses import dataclass, replace

from kvferry.tools.gpucheck.devkv import Side
from kvferry.tools.gpucheck.pages import BACKENDS, DTYPES, ORDERS
from kvferry.tools.gpucheck.ranks import Rank, RankSpec

TP_SPLITS = ((1, 1), (2, 1), (1, 2))
BLOCK_PAIRS = ((16, 32), (32, 16), (16, 16), (32, 32))
RAW_REPEATS = 3


@dataclass(frozen=True)
class Case:
    name: str
    p: Side
    d: Side
    tokens: int
    requests: int


@dataclass(frozen=True)
class Outcome:
    case: Case
    mismatches: int
    received: int
    gated: int  # WRITEs posted after their KV write's event had completed
    writes: int
    connector_gbps: float
    raw_gbps: float
    early: bool | None = None  # gate control: posted before the event (None: no events here)

    @property
    def ok(self) -> bool:
        c = self.case
        ranks = c.d.tp_size * c.requests
        return self.mismatches == 0 and self.received == ranks and self.gated == self.writes


def cases(model: Side, *, quick: bool, tokens: int) -> list[Case]:
    """Each (backend, KV dtype, order) once as a producer, another order as its consumer (so every
    order is on each side), TP splits and block sizes in rotation; then the staged pass. `model`
    gives the model's shape, the cache size and the device."""

    def side(backend: str, order: str, bs: int, tp: int, dtype: str, staged: bool = False) -> Side:
        return replace(model, backend=backend, order=order, block_size=bs, tp_size=tp, kv_dtype=dtype,
                       staged=staged)  # fmt: skip

    out: list[Case] = []
    combos = [(b, dt, i) for b in BACKENDS for dt in DTYPES for i in range(len(ORDERS))]
    for k, (backend, dtype, i) in enumerate(combos):
        (ptp, dtp), (pbs, dbs) = TP_SPLITS[k % 3], BLOCK_PAIRS[(k // 3) % 4]
        other = BACKENDS[(BACKENDS.index(backend) + k) % 2]
        p = side(backend, ORDERS[i], pbs, ptp, dtype)
        d = side(other, ORDERS[(i + 1 + k // 4) % 4], dbs, dtp, dtype)
        out.append(Case(f"{p.describe()} -> {d.describe()} {dtype}", p, d, tokens, 3))
    for k, (backend, dtype) in enumerate((b, dt) for b in BACKENDS for dt in DTYPES):
        (ptp, dtp), (pbs, dbs) = TP_SPLITS[k % 3], BLOCK_PAIRS[k % 4]
        p = side(backend, ORDERS[k % 4], pbs, ptp, dtype, staged=True)
        d = side(backend, ORDERS[(k + 2) % 4], dbs, dtp, dtype, staged=True)
        out.append(Case(f"{p.describe()} -> {d.describe()} {dtype} staged", p, d, tokens, 3))
    return cover(out) if quick else out


def features(c: Case) -> set[tuple[str, object]]:
    return {
        ("p", c.p.backend), ("d", c.d.backend), ("p", c.p.order), ("d", c.d.order), ("dtype", c.p.kv_dtype),
        ("tp", (c.p.tp_size, c.d.tp_size)), ("bs", (c.p.block_size, c.d.block_size)), ("staged", c.p.staged),
    }  # fmt: skip


def cover(todo: list[Case]) -> list[Case]:
    """The fewest cases (greedy) that still have every backend and order on each side, every KV
    dtype, TP split, block-size pair and both passes; the most covering first."""
    left: set[tuple[str, object]] = set().union(*map(features, todo))
    out: list[Case] = []
    while left:
        best = max(todo, key=lambda c: len(features(c) & left))
        out.append(best)
        left -= features(best)
    return out


def free_port_pair() -> int:
    """A base port with base + 1 also free (TP rank r listens on base + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = int(a.getsockname()[1])
            with socket.socket() as b, contextlib.suppress(OSError):
                b.bind(("127.0.0.1", base + 1))
                return base
    raise RuntimeError("no free port pair on 127.0.0.1")


class Pool:
    """Rank processes reused across cases (reset to each case's spec), stopped at the end."""

    def __init__(self) -> None:
        self.procs: dict[str, list[Rank]] = {"producer": [], "consumer": []}

    def ranks(self, role: str, engine: str, side: Side) -> list[Rank]:
        port = free_port_pair() if side.tp_size > 1 else 0
        have = self.procs[role]
        for r in range(side.tp_size):
            spec = RankSpec(role, engine, r, side, port)
            if r < len(have):
                have[r].reset(spec)
            else:
                have.append(Rank(spec))
        return have[: side.tp_size]

    def stop(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                p.stop()


def blocks_for(tokens: int, block_size: int, first: int, reverse: bool = False) -> list[int]:
    ids = list(range(first, first + -(-tokens // block_size)))
    return ids[::-1] if reverse else ids


def run_case(pool: Pool, case: Case, engine: int, *, control: bool = False) -> Outcome:
    p_engine, d_engine = f"prefill-{engine}", f"decode-{engine}"
    prods = pool.ranks("producer", p_engine, case.p)
    cons = pool.ranks("consumer", d_engine, case.d)
    n, mismatches, received = case.tokens, 0, 0
    for i in range(case.requests):
        rid = f"req-{i}"
        p_blocks = blocks_for(n, case.p.block_size, 2 + i * -(-n // case.p.block_size), reverse=True)
        d_blocks = blocks_for(n, case.d.block_size, 1 + i * -(-n // case.d.block_size))
        kw = dict(
            producer_engine=p_engine, producer_host="127.0.0.1", producer_port=prods[0].port,
            producer_tp=case.p.tp_size, block_ids=[d_blocks], num_tokens=n, deadline_s=60.0,
        )  # fmt: skip
        for c in cons:
            c.call("expect", rid, kw)
        ungated = control and i > 0  # the control's first request connects the pair, gated
        for p in prods:
            p.call("finish", rid, p_blocks, n, d_engine, not ungated, 1.0 if ungated else 0.1)
        for c in cons:
            got = c.call("results", 60.0, 1, timeout_s=90.0)
            received += got["received"] == [(rid, 0)]
            c.call("land", d_blocks)
            mismatches += c.call("mismatches", d_blocks, n, timeout_s=300.0)
        for p in prods:
            p.call("results", 30.0, 1, timeout_s=60.0)
    records, posted = [], []
    for p in prods:
        w = p.call("writes")
        records += w["writes"]
        posted += w["posted_after_event"]
    nbytes = sum(r[0] for r in records)
    connector = nbytes / max(sum(r[1] for r in records), 1e-12) / 1e9
    one = max((r[0] for r in records), default=0)
    target = cons[0].call("raw_target", one, RAW_REPEATS)
    raw = one / min(prods[0].call("raw_write", target, one, RAW_REPEATS)) / 1e9
    gated = sum(1 for x in posted if x is not False)
    early = None if all(x is None for x in posted) else any(x is False for x in posted)
    return Outcome(case, mismatches, received, gated, len(posted), connector, raw, early)


def line(o: Outcome) -> str:
    c = o.case
    mem = "DRAM(staged)" if c.p.staged else ("VRAM" if c.p.device == "cuda" else "DRAM")
    gate = "n/a (no CUDA events)" if o.early is None else f"{o.gated}/{o.writes} after event"
    return (
        f"{'ok  ' if o.ok else 'FAIL'} {c.name} [{mem}] tokens={c.tokens}x{c.requests} "
        f"received={o.received}/{c.d.tp_size * c.requests} mismatches={o.mismatches} gate={gate} "
        f"connector={o.connector_gbps:.3f} GB/s raw={o.raw_gbps:.3f} GB/s"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvferry gpu-check", description=__doc__)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: DRAM caches, no GPU")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the fewest cases that still cover every backend, order, dtype, split and pass",
    )
    ap.add_argument("--tokens", type=int, default=0, help="tokens per request (default 512 cuda, 100 cpu)")
    ap.add_argument(
        "--only", default="", help="run only cases whose name contains one of these (comma-separated)"
    )
    ap.add_argument("--max-cases", type=int, default=0, help="run at most this many cases (the first ones)")
    ap.add_argument(
        "--budget-s", type=float, default=330.0,
        help="start no case after this many seconds; cases left are reported SKIP and fail the run",
    )  # fmt: skip
    args = ap.parse_args(argv)
    # one line per case: no NIXL agent banners (the rank processes inherit it)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device (torch.cuda.is_available() is False); use --device cpu",
            file=sys.stderr,
        )
        return 2
    gpu = args.device == "cuda"
    tokens = args.tokens or (512 if gpu else 100)
    blocks = 2 + 3 * -(-tokens // 16) + 2  # three requests' blocks at 16 tokens, and unused ones around
    layers, heads, head_dim = (8, 8, 128) if gpu else (2, 4, 64)
    model = Side("", "", 16, 1, "", layers=layers, heads=heads, head_dim=head_dim, num_blocks=blocks,
                 device=args.device)  # fmt: skip
    wanted = [w for w in args.only.split(",") if w]
    every = cases(model, quick=args.quick, tokens=tokens)
    todo = [c for c in every if not wanted or any(w in c.name for w in wanted)]
    todo = todo[: args.max_cases or None]
    if not todo:
        print(f"gpu-check: no case matches --only {args.only!r}", file=sys.stderr)
        return 2
    pool, t0 = Pool(), time.monotonic()
    equal, failed = 0, 0
    try:
        failed += gpu and not gate_control(pool, todo[0])
        for i, case in enumerate(todo, start=1):
            if time.monotonic() - t0 > args.budget_s:  # a partial run is no pass: say what was left
                print(f"SKIP {case.name}: past --budget-s {args.budget_s:.0f}", flush=True)
                failed += 1
                continue
            o = run_case(pool, case, i)
            equal += o.ok
            failed += not o.ok
            print(line(o), flush=True)
    finally:
        pool.stop()
    print(f"gpu-check: {equal}/{len(todo)} cases equal, {failed} failed, {time.monotonic() - t0:.0f} s")
    return 1 if failed else 0


def gate_control(pool: Pool, case: Case) -> bool:
    """Hand requests over without the gate: the measurement must see a WRITE posted before its
    event, or its `gate=n/n` on the real cases proves nothing."""
    ctl = replace(case, requests=2, name="gate control (ungated hand-off): " + case.name)
    o = run_case(pool, ctl, 0, control=True)
    seen = "posted before the event, as it must be" if o.early else "NOT seen posted early: FAIL"
    print(f"info {ctl.name}: {seen}", flush=True)
    return bool(o.early)
