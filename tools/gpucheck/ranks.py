"""GPU check step: one connector endpoint per TP rank in its own process, with a DeviceKV.

The parent sends commands over a pipe; each call has a timeout and `stop()` ends the child by PID.
The producer hands a request over the way the worker does (worker.py `_hand_over`/`_after`): the
KV write (and, staged, the device-to-host copy) is only launched, a CUDA event is recorded after it
and polled, and the endpoint gets the request once the event has passed. The transport's `write`
is wrapped to measure, at the moment the WRITE is posted, whether that event had completed.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

from kvferry.tools.gpucheck.devkv import DeviceKV, Side
from kvferry.tools.gpucheck.raw import RawAgent

GATE_TIMEOUT_S = 60.0
_RAW_AGENTS = itertools.count(1)  # raw agent names are never reused: a peer may still hold the old one


@dataclass(frozen=True)
class RankSpec:
    role: str  # producer | consumer
    engine_id: str
    tp_rank: int
    side: Side
    side_channel_port: int = 0


class Rank:
    """Parent-side handle of one rank process."""

    def __init__(self, spec: RankSpec, timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")  # a clean interpreter: no inherited CUDA, NIXL or UCX state
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child, args=(child, spec), name=f"gpucheck-{spec.role}-{spec.tp_rank}"
        )
        self.proc.start()
        child.close()
        self.port: int = self._reply(timeout_s)

    def reset(self, spec: RankSpec, timeout_s: float = 120.0) -> None:
        """A fresh cache and endpoint for `spec` in the same process (torch and CUDA start once)."""
        self.conn.send(("reset", (spec,)))
        self.port = self._reply(timeout_s)

    def call(self, op: str, *args: Any, timeout_s: float = 120.0) -> Any:
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

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(("stop", ()))
            self.proc.join(timeout_s)
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)
        self.conn.close()


def _child(conn: Any, spec: RankSpec | None) -> None:
    rank: RankState | None = None
    try:
        while True:
            if spec is not None:
                if rank is not None:
                    rank.close()
                try:
                    rank = RankState(spec)
                except Exception:
                    conn.send(("error", "start failed: " + traceback.format_exc(limit=4)))
                    return
                conn.send(("ok", rank.ep.side_port))
                spec = None
            op, args = conn.recv()
            if op == "stop":
                break
            if op == "reset":
                spec = args[0]
                continue
            try:
                assert rank is not None
                conn.send(("ok", getattr(rank, "op_" + op)(*args)))
            except Exception:
                conn.send(("error", traceback.format_exc(limit=4)))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if rank is not None:
            rank.close()


class RankState:
    """Child side: the cache, the optional host stage, the endpoint and the gate measurement."""

    def __init__(self, spec: RankSpec) -> None:
        from kvferry.connector.config import KvferryConfig
        from kvferry.connector.endpoint import Endpoint
        from kvferry.connector.staging import HostStage

        if spec.side.device == "cuda":
            import torch

            torch.cuda.set_device(0)
        self.spec, self.kv = spec, DeviceKV(spec.side, spec.tp_rank)
        self.stage = (
            HostStage({str(i): t for i, t in enumerate(self.kv.tensors)}, [0] * len(self.kv.tensors))
            if spec.side.staged
            else None
        )
        layout = self.stage.rebase(self.kv.layout) if self.stage else self.kv.layout
        cfg = KvferryConfig.from_extra(
            {"backends": ["UCX"], "side_channel_port": spec.side_channel_port, "deadline_s": 60.0}
        )
        self.ep = Endpoint(
            cfg, role=spec.role, engine_id=spec.engine_id, tp_rank=spec.tp_rank,
            tp_size=spec.side.tp_size, layout=layout,
        ).start()  # fmt: skip
        self.gate: Any = None  # the event the current hand-off waits for
        self.posted: list[bool | None] = []  # per WRITE: had the gate event completed (None: no event)
        transport = self.ep.transport
        assert transport is not None, "the endpoint creates its transport before start() returns"
        post = transport.write

        def measured(*a: Any, **kw: Any) -> Any:
            self.posted.append(None if self.gate is None else bool(self.gate.query()))
            return post(*a, **kw)

        transport.write = measured  # type: ignore[method-assign]
        self._raw: RawAgent | None = None

    def close(self) -> None:
        self.ep.close()
        if self._raw is not None:
            self._raw.close()

    # ---- producer ----
    def op_finish(
        self, request_id: str, blocks: list[int], num_tokens: int, consumer: str, gated: bool, busy_s: float
    ) -> None:
        """Launch the KV write behind `busy_s` of GPU work (so an ungated hand-off would post the
        WRITE before the KV is there), then hand over after its event (gated) or at once."""
        on_gpu = self.spec.side.device == "cuda"
        if on_gpu:
            import torch

            torch.cuda._sleep(int(busy_s * 2e9))  # spin cycles: ~busy_s at the H200's ~2 GHz
        self.kv.fill(blocks, num_tokens)
        event = self.stage.to_host([blocks]) if self.stage else None
        if event is None and on_gpu:
            import torch

            event = torch.cuda.Event()
            event.record()
        self.gate = event
        if gated and event is not None:
            end = time.monotonic() + GATE_TIMEOUT_S
            while not event.query():  # polled, as the worker does each step
                if time.monotonic() > end:
                    raise TimeoutError(f"the KV write's CUDA event did not complete in {GATE_TIMEOUT_S}s")
                time.sleep(0.0005)
        self.ep.prefill_finished(request_id, 0, [blocks], num_tokens, consumer)

    def op_sync(self) -> None:
        if self.spec.side.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def op_writes(self) -> dict[str, Any]:
        """Completed WRITEs since the last call, and the gate measurement of each posted one."""
        records = [(r.nbytes, r.write_s, r.descriptors, r.mode) for r in list(self.ep.recent)]
        self.ep.recent.clear()
        posted, self.posted = self.posted, []
        return {"writes": records, "posted_after_event": posted}

    def op_raw_write(self, target: tuple[bytes, int, int, str], nbytes: int, repeats: int) -> list[float]:
        """Seconds per one-descriptor NIXL WRITE of `nbytes` into the peer's raw buffer."""
        return self._new_raw(nbytes).write(target, repeats)

    def _new_raw(self, nbytes: int) -> RawAgent:
        """A raw agent in the memory NIXL registers for this side (host twins when staged)."""
        if self._raw is not None:
            self._raw.close()
        device = "cpu" if self.stage else self.spec.side.device
        self._raw = RawAgent(f"raw-{self.spec.role}-{os.getpid()}-{next(_RAW_AGENTS)}", nbytes, device)
        return self._raw

    # ---- consumer ----
    def op_expect(self, request_id: str, kw: dict[str, Any]) -> None:
        self.ep.expect(request_id, 0, **kw)

    def op_results(self, timeout_s: float, want: int) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"sent": [], "released": [], "received": [], "failed": []}
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and sum(map(len, out.values())) < want:
            r = self.ep.wait_results(max(0.0, end - time.monotonic()))
            for name in out:
                out[name] += getattr(r, name)
        return out

    def op_land(self, blocks: list[int]) -> None:
        """Staged: copy the landed blocks host -> device (worker `_received`), and wait for it."""
        if self.stage is not None:
            event = self.stage.to_device([blocks])
            if event is not None:
                event.synchronize()

    def op_mismatches(self, blocks: list[int], num_tokens: int) -> int:
        return self.kv.mismatches(blocks, num_tokens)

    def op_raw_target(self, nbytes: int, repeats: int) -> tuple[bytes, int, int, str]:
        return self._new_raw(nbytes).serve(repeats)
