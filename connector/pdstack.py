"""Local P/D step: start a prefill + decode pair and the router on loopback, for tests and benches.

Modes map to connectors: `vllm-pull` -> NixlConnector, `vllm-push` -> NixlPushConnector,
`kvferry` -> KvferryConnector. P's worker gets core 0 and D's core 1 (the 2-core layout that works;
`auto` binding is ~10x slower). Every process is stopped by PID (process group) in `stop()`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from kvferry.connector.serve import ServerSpec, VllmProcess, free_port

CONNECTORS = {"vllm-pull": "NixlConnector", "vllm-push": "NixlPushConnector", "kvferry": "KvferryConnector"}


def kvferry_connector_available() -> bool:
    """True once the kvferry vLLM connector class exists in this checkout (checked without importing
    vLLM: vLLM loads it as `kv_connector_module_path` "kvferry.connector")."""
    import importlib.util

    spec = importlib.util.find_spec("kvferry.connector.connector")
    if spec is None or spec.origin is None:
        return False
    return "class KvferryConnector" in Path(spec.origin).read_text()


@dataclass
class RouterProcess:
    """`kvferry router` in its own process group, on a free loopback port."""

    config: dict[str, Any]
    workdir: Path
    env: dict[str, str] | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> RouterProcess:
        cfg_path = self.workdir / "router.yaml"
        cfg_path.write_text(
            yaml.safe_dump({**self.config, "listen": {"host": "127.0.0.1", "port": self.port}})
        )
        self.log_path = self.workdir / "router.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvferry.cli", "router", "--config", str(cfg_path)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"router exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router not healthy after {timeout_s}s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class PdStack:
    """Prefill + decode + router for one mode; `start()` waits until all are healthy."""

    mode: str
    model: Path
    workdir: Path
    prefill_block_size: int | None = None
    decode_block_size: int | None = None
    no_progress_thread: bool = True
    deadlines: dict[str, float] = field(default_factory=dict)
    kv_cache_gib: float = 1.0
    dtype: str = "float32"  # both servers' --dtype: the model's (tinymodel.Shape.dtype)
    kvferry_extra: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config overrides
    prefill: VllmProcess | None = None
    decode: VllmProcess | None = None
    router: RouterProcess | None = None

    def _server(self, role: str, cores: str, block_size: int | None) -> VllmProcess:
        connector = CONNECTORS[self.mode]
        spec = ServerSpec(
            model=self.model, port=free_port(), role=role, connector=connector, engine_id=f"{role}-0",
            side_port=free_port(), block_size=block_size, cores=cores, kv_cache_gib=self.kv_cache_gib,
            dtype=self.dtype,
            # Upstream baselines only; the kvferry connector owns its NIXL agent config.
            no_progress_thread=self.no_progress_thread and connector != "KvferryConnector",
            # kvferry defaults to LIBFABRIC (EFA); loopback on a CPU host is UCX.
            connector_extra=(
                {"backends": ["UCX"], **self.kvferry_extra} if connector == "KvferryConnector" else {}
            ),
        )  # fmt: skip
        return VllmProcess(spec, self.workdir / f"{role}.log")

    def router_config(self) -> dict[str, Any]:
        assert self.prefill is not None and self.decode is not None
        entry = lambda p: {  # noqa: E731
            "url": p.url, "engine_id": p.spec.engine_id, "side_host": p.spec.host,
            "side_port": p.spec.side_port, "tp_size": 1, "revision": "r1",
        }  # fmt: skip
        return {
            "mode": self.mode,
            "model": "tiny",
            "deadlines": self.deadlines,
            "discovery": {"static": {"prefill": [entry(self.prefill)], "decode": [entry(self.decode)]}},
        }

    def start(self, ready_timeout_s: float = 600.0) -> PdStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.prefill = self._server("prefill", "0", self.prefill_block_size).start()
            self.decode = self._server("decode", "1", self.decode_block_size).start()
            self.prefill.wait_ready(ready_timeout_s)
            self.decode.wait_ready(ready_timeout_s)
            # NIXL's worker init re-pins the model thread to the last core; put each back on its own.
            self.prefill.pin()
            self.decode.pin()
            self.router = RouterProcess(self.router_config(), self.workdir).start()
            self.warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def warm_up(self) -> None:
        """One request end to end, so the first P<->D NIXL handshake is done before measurements.

        Upstream push loses registrations that arrive while its first handshake runs (observed: 4 of
        the first 11 requests at concurrency 4 waited forever); the router recovers those by
        recompute, but equality and bench runs should measure the steady state."""
        body = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 2, "temperature": 0}
        resp = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
        resp.raise_for_status()

    def stop(self) -> None:
        for part in (self.router, self.decode, self.prefill):
            if part is not None:
                part.stop()

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url
