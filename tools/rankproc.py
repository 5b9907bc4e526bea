"""Demo step: one kvferry endpoint per TP rank in its own process, driven by commands over a pipe.

`kvferry transfer-demo`, tests/nixl and bench/transfer_bench.py use it to run real NIXL agents in
separate processes (as vLLM's workers are). Every call has a timeout, and `stop()` ends the process
by its PID, killing it if it does not exit in time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from kvferry.connector.config import KvferryConfig
from kvferry.tools.hostkv import CacheShape, host_kv


@dataclass(frozen=True)
class RankSpec:
    role: str  # producer | consumer
    engine_id: str
    tp_rank: int
    shape: CacheShape
    extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config


class RankProcess:
    """Parent-side handle of one endpoint process."""

    def __init__(self, spec: RankSpec, start_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")  # a clean interpreter: no inherited NIXL/UCX state
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_main, args=(child, spec), name=f"kvferry-{spec.role}-{spec.tp_rank}"
        )
        self.proc.start()
        child.close()
        self.port = self._reply(start_timeout_s)

    def reset(self, spec: RankSpec, timeout_s: float = 60.0) -> int:
        """Replace the child's cache and endpoint with new ones for `spec` (same process: heavy
        imports such as vLLM's are paid once); returns the new side-channel port."""
        self.spec = spec
        self.conn.send(("reset", (spec,)))
        self.port = self._reply(timeout_s)
        return self.port

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def call(self, op: str, *args: Any, timeout_s: float = 60.0) -> Any:
        if op == "results":  # the child waits up to args[0] itself: leave it room to answer
            timeout_s = max(timeout_s, args[0] + 30.0)
        self.conn.send((op, args))
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.proc.name} (pid {self.proc.pid}) did not answer within {timeout_s}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"{self.proc.name} (pid {self.proc.pid}) exited: {self.proc.exitcode}"
            ) from None
        if status != "ok":
            raise RuntimeError(f"{self.proc.name}: {value}")
        return value

    def kill(self) -> None:
        """Hard kill (the 'peer died' fault)."""
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(5)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(("stop", ()))
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


def _child_main(conn: Any, spec: RankSpec) -> None:
    ep = None
    try:
        while True:
            if spec is not None:  # (re)start: a fresh cache and endpoint for this spec
                if ep is not None:
                    ep.close()
                try:
                    kv, ep = _start(spec)
                except Exception as exc:
                    conn.send(("error", f"start failed: {exc}"))
                    return
                conn.send(("ok", ep.side_port))
                spec = None
            op, args = conn.recv()
            if op == "stop":
                break
            if op == "reset":
                spec = args[0]
                continue
            try:
                conn.send(("ok", _handle(ep, kv, op, args)))
            except Exception:
                conn.send(("error", traceback.format_exc(limit=3)))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if ep is not None:
            ep.close()


def _start(spec: RankSpec) -> tuple[Any, Any]:
    from kvferry.connector.endpoint import Endpoint

    kv = host_kv(spec.shape, spec.tp_rank)
    cfg = KvferryConfig.from_extra({"backends": ["UCX"], "side_channel_port": 0, **spec.extra})
    ep = Endpoint(
        cfg,
        role=spec.role,
        engine_id=spec.engine_id,
        tp_rank=spec.tp_rank,
        tp_size=spec.shape.tp_size,
        layout=kv.layout,
    ).start()
    return kv, ep


def _handle(ep: Any, kv: Any, op: str, args: tuple) -> Any:
    if op == "finish":  # producer: prefill computed -> fill the blocks, hand them over
        request_id, attempt, blocks, num_tokens, consumer, *fill = args
        if not fill or fill[0]:
            kv.fill(blocks, num_tokens)
        t0 = time.perf_counter()
        ep.prefill_finished(request_id, attempt, [blocks], num_tokens, consumer)
        return time.perf_counter() - t0  # the hand-off cost on the caller's thread
    if op == "abort":
        request_id, attempt = args
        (ep.prefill_aborted if ep.role == "producer" else ep.abort)(request_id, attempt)
        return None
    if op == "expect":
        request_id, attempt, kw = args
        ep.expect(request_id, attempt, **kw)
        return None
    if op == "results":  # everything that finishes within the timeout, or until `want` results
        (timeout_s, want) = args
        return _collect(ep, timeout_s, want)
    if op == "mismatches":
        blocks, num_tokens = args
        return kv.mismatches(blocks, num_tokens)
    if op == "clear":
        blocks, num_tokens = args
        kv.clear(blocks, num_tokens)
        return None
    if op == "corrupt_writes":  # fault injection: the KV changes after the sentinel digested it
        post = ep.transport.write

        def corrupted(
            agent: str, src_blocks: list[list[int]], dst: Any, num_tokens: int, *a: Any, **kw: Any
        ) -> Any:
            kv.clear(src_blocks[0], num_tokens)  # what the WRITE then carries is not what was digested
            return post(agent, src_blocks, dst, num_tokens, *a, **kw)

        ep.transport.write = corrupted
        return None
    if op == "dead":  # why the endpoint thread stopped ("" while it serves)
        return ep.dead
    if op == "writes":  # completed WRITEs since the last call (benchmark)
        records = [dataclasses.asdict(r) for r in list(ep.recent)]
        ep.recent.clear()
        return records
    if op == "layout":
        return kv.layout.describe()
    if op == "metrics":
        from prometheus_client import generate_latest

        return generate_latest(ep.metrics.registry).decode()
    raise ValueError(f"unknown op {op!r}")


def _collect(ep: Any, timeout_s: float, want: int) -> dict[str, list]:
    out: dict[str, list] = {"sent": [], "released": [], "received": [], "failed": []}
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and sum(map(len, out.values())) < want:
        r = ep.wait_results(max(0.0, end - time.monotonic()))
        for name in out:
            out[name] += getattr(r, name)
    return out
