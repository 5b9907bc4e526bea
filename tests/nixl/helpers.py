"""Helpers for the NIXL process tests: rank processes stopped by PID, free ports, request args."""

from __future__ import annotations

import contextlib
import socket

from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.hostkv import CacheShape
from kvferry.tools.rankproc import RankProcess, RankSpec

from tests.waiting import wait_until

FAST = {"lease_s": 3.0, "registration_ttl_s": 3.0, "handshake_timeout_s": 1.0, "handshake_attempts": 2}


def free_port_pair() -> int:
    """A base port with base+1 also free (TP rank r listens on base + r)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            with socket.socket() as b, contextlib.suppress(OSError):
                b.bind(("127.0.0.1", base + 1))
                return base
    raise RuntimeError("no free port pair on 127.0.0.1")


class Procs:
    """Starts rank processes and stops every one of them (by PID) at teardown."""

    def __init__(self) -> None:
        self.all: list[RankProcess] = []

    def start(self, role: str, engine: str, shape: CacheShape, ranks: int = 1, **extra) -> list[RankProcess]:
        if ranks > 1 and "side_channel_port" not in extra:
            extra["side_channel_port"] = free_port_pair()
        started = [RankProcess(RankSpec(role, engine, r, shape, {**FAST, **extra})) for r in range(ranks)]
        self.all += started
        return started


class ProcPool(Procs):
    """Rank processes reused across tests (reset to each new spec): for caches whose setup imports
    vLLM (~10 s a process), so a test pays only for its cache and endpoint. Idle processes are reset;
    one that does not answer is replaced by a fresh process."""

    def __init__(self) -> None:
        super().__init__()
        self.idle: list[RankProcess] = []

    def start(self, role: str, engine: str, shape: CacheShape, ranks: int = 1, **extra) -> list[RankProcess]:
        if ranks > 1 and "side_channel_port" not in extra:
            extra["side_channel_port"] = free_port_pair()
        out = []
        for r in range(ranks):
            spec = RankSpec(role, engine, r, shape, {**FAST, **extra})
            proc = self.idle.pop() if self.idle else None
            try:
                if proc is not None:
                    proc.reset(spec)
            except (RuntimeError, TimeoutError, OSError):
                proc.stop()
                self.all.remove(proc)
                proc = None
            if proc is None:
                proc = RankProcess(spec)
                self.all.append(proc)
            out.append(proc)
        return out

    def release(self) -> None:
        self.idle = [p for p in self.all if p.proc.is_alive()]


def expect_args(
    prod: RankProcess,
    blocks: list[int],
    tokens: int,
    *,
    tp: int = 1,
    deadline_s: float = 20.0,
    engine: str = "prefill-0",
) -> dict:
    return dict(
        producer_engine=engine,
        producer_host="127.0.0.1",
        producer_port=prod.port,
        producer_tp=tp,
        block_ids=[blocks],
        num_tokens=tokens,
        deadline_s=deadline_s,
    )


def parked_on(prod: RankProcess, n: int = 1) -> None:
    """Wait until P holds `n` registrations without a finished prefill to match (its pending gauge)."""
    wait_until(
        lambda: metric_sum(parse_metrics(prod.call("metrics")), "kvferry_pending", kind="registrations"),
        f"{n} registration(s) parked on the producer",
        timeout_s=10,
        interval_s=0.05,
        until=lambda parked: parked >= n,
    )
