"""The servers of a (backend, dtype, KV buffer device) group: started one at a time on first use,
stopped by PID together, and the layout lines they logged (and whether they staged through host)."""

from __future__ import annotations

import argparse
import re
import time
import uuid
from pathlib import Path
from typing import Any

from kvferry.tools.pdclient import HOST
from kvferry.tools.serve import VllmProcess, free_port

from .command import GpuServerSpec, server_command, server_env

VLLM_LOG_RE = re.compile(r"KV cache layout|Using \S+ backend|attention backend", re.IGNORECASE)
NOISE_RE = re.compile(r"kv_transfer_config|KVTransferConfig|non-default args", re.IGNORECASE)
LINE_CHARS = 300
STAGED = "staged through host memory"  # the worker's layout line ends so when it stages (worker.py)


class GpuServer(VllmProcess):
    """serve.py's VllmProcess (own process group, /health wait, scrape, stop by PID), GPU command."""

    def __init__(self, spec: GpuServerSpec, log_path: Path) -> None:
        super().__init__(spec.server_spec(), log_path)
        self.gspec = spec

    def command_line(self) -> list[str]:
        return server_command(self.gspec)

    def environment(self) -> dict[str, str]:
        return server_env(self.gspec)


class StartError(RuntimeError):
    pass


class Group:
    """The servers of one (backend, dtype, KV buffer device) group: started on first use, stopped
    together. The buffer device only reaches P and D (the single server has no connector)."""

    def __init__(
        self,
        key: tuple[str, str, str],
        model: Path,
        args: argparse.Namespace,
        env: dict[str, Any],
    ) -> None:
        self.attention, self.kv_dtype, self.kv_buffer_device = key
        self.model, self.args, self.env = model, args, env
        self.servers: dict[tuple[str, int], GpuServer] = {}
        self.failed: dict[tuple[str, int], str] = {}
        self.tag = f"{self.attention.lower()}-{self.kv_dtype}-buf{self.kv_buffer_device}"

    def spec(self, role: str, block: int) -> GpuServerSpec:
        connector = role != "single"
        return GpuServerSpec(
            model=self.model,
            port=free_port(HOST),
            role=role,
            attention=self.attention,
            kv_dtype=self.kv_dtype,
            block_size=block,
            kv_buffer_device=self.kv_buffer_device,
            engine_id=f"gpucheck-{role}-{block}-{uuid.uuid4().hex[:6]}" if connector else None,
            side_port=free_port(HOST) if connector else None,
            nixl_backend=self.args.backend,
            gpu=self.args.gpu,
            gpu_memory_utilization=self.args.gpu_memory_utilization,
            enforce_eager=self.args.enforce_eager,
            dtype=self.args.dtype,
            max_model_len=self.args.max_model_len,
            attention_via=self.env["attention_via"],
            launcher=self.env["launcher"],
            kv_cache_layout=self.args.kv_cache_layout,
            log_config=self.env["log_config"],
            extra_args=tuple(self.args.vllm_arg or ()),
        )

    def server(self, role: str, block: int) -> GpuServer:
        """The group's server for (role, block), started and healthy; StartError when it did not start."""
        key = (role, block)
        if key in self.failed:
            raise StartError(self.failed[key])
        if key not in self.servers:
            self._start(key)
        return self.servers[key]

    def _start(self, key: tuple[str, int]) -> None:
        role, block = key
        log = Path(self.env["workdir"]) / f"{self.tag}-{role}{block}.log"
        server = GpuServer(self.spec(role, block), log)
        self.servers[key] = server
        t0 = time.monotonic()
        print(f"  starting {role} (block {block}) on :{server.spec.port}, log {log}", flush=True)
        try:
            server.start().wait_ready(self.args.ready_timeout)
        except (RuntimeError, TimeoutError) as exc:
            server.stop()
            head = str(exc).partition(": ")[0]  # "vLLM decode exited with 1", "... not healthy after 600s"
            self.failed[key] = f"{role} server (block {block}) did not start ({head}); log {log}"
            print(f"  FAILED: {self.failed[key]}; log tail:\n{server.log_tail(4000)}", flush=True)
            raise StartError(self.failed[key]) from None
        print(f"  {role} ready in {time.monotonic() - t0:.0f}s", flush=True)

    def stop(self, key: tuple[str, int]) -> None:
        server = self.servers.get(key)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


def read_log(server: VllmProcess) -> str:
    path = server.log_path
    return path.read_bytes().decode(errors="replace") if path is not None and path.exists() else ""


def layout_lines(text: str, limit: int = 4) -> list[str]:
    """The connector's layout lines (kvferry ... layout); without them its first kvferry lines;
    plus vLLM's own attention-backend and KV-cache-layout lines."""
    lines = [ln.strip()[:LINE_CHARS] for ln in text.splitlines() if ln.strip() and not NOISE_RE.search(ln)]
    kvferry = [ln for ln in lines if "kvferry" in ln.lower()]
    chosen = [ln for ln in kvferry if "layout" in ln.lower()] or kvferry
    vllm = [ln for ln in lines if VLLM_LOG_RE.search(ln) and ln not in chosen]
    return chosen[:limit] + vllm[:limit]


def staged(text: str) -> bool | None:
    """Whether the connector's layout line (`kvferry <role> rank N: KV layout ...`) says it stages
    through host memory; None when the log has no such line."""
    lines = [ln for ln in text.splitlines() if "kvferry" in ln and "KV layout" in ln]
    return any(STAGED in ln for ln in lines) if lines else None
