"""Local P/D step: start a prefill + decode pair and the router on loopback, for tests and benches.

Modes map to connectors: `vllm-pull` -> NixlConnector, `vllm-push` -> NixlPushConnector,
`kvferry` -> KvferryConnector. P's worker gets core 0 and D's core 1 (the 2-core layout that works;
`auto` binding is ~10x slower). Every process is stopped by PID (process group) in `stop()`.

Faults for soak runs (bench/soak.py): `kill(role)` sends SIGKILL to one engine's process group,
`restart(role)` starts it again with the same engine id, ports and side channel (a new log file per
incarnation), `pause(role)` / `resume(role)` send SIGSTOP / SIGCONT. `gauges()` and `settle()` read
the gauges that must be 0 on an idle stack; `MemoryWatch` samples the RSS of each part with its
children; `orphan_shm()` lists /dev/shm files that killed engines left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.serve import ServerSpec, VllmProcess, _descendants, free_port, parse_cores, pin_tree

CONNECTORS = {"vllm-pull": "NixlConnector", "vllm-push": "NixlPushConnector", "kvferry": "KvferryConnector"}
ENGINE_ROLES = ("prefill", "decode")
# Gauges that are 0 on an idle stack; with every kvferry_pending series (per kind) on both engines.
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
ROUTER_GAUGES = ("kvferry_router_in_flight", "kvferry_router_detached_prefills")


def tree_pids(pid: int) -> list[int]:
    """The process and all its descendants (children can be gone by the time they are read)."""
    return [pid, *_descendants(pid)]


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants, summed (shared pages count once per process)."""
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
    return total


def tree_shm_files(pid: int) -> set[str]:
    """/dev/shm files mapped by a process or its descendants (vLLM's engine<->worker queues)."""
    found: set[str] = set()
    for p in tree_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith("/dev/shm/"):
                    found.add(path[0].removesuffix(" (deleted)"))
    return found


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

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10.0).text)

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


ROLE_CORES = {"prefill": "0", "decode": "1"}  # each engine's core
LOAD_ON = {"anywhere": "", "prefill": ROLE_CORES["prefill"]}  # --load-on: the router's and client's cores


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """The P/D benches' --pin: whole (PdStack.pin_whole) or worker (the pinning of results before
    2026-12-03 15:40); and --load-on: where the router and the client run (PdStack.load_cores)."""
    parser.add_argument(
        "--pin", choices=("whole", "worker"), default="whole",
        help="whole: each engine's processes all on its cores, as a pod's CPU set holds them; worker: "
        "only its worker (API server and engine core free to run on the other engine's core)",
    )  # fmt: skip
    parser.add_argument(
        "--load-on", choices=tuple(LOAD_ON), default="anywhere",
        help="anywhere: the router and the client run wherever the OS puts them, decode's core too; "
        "prefill: on prefill's core, so decode's core holds decode alone, as on its own node",
    )  # fmt: skip


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
    load_failure_policy: str = "fail"  # decode's kv_load_failure_policy
    router_extra: dict[str, Any] = field(default_factory=dict)  # router.yaml keys, e.g. limits
    kv_events: bool = False  # engines publish vLLM's KV-cache events; the router follows them
    # every process of an engine on its core (a pod's CPU set), not only its worker: without it a
    # role's API server and engine core also run on the other role's core (bench/pd_ttft_breakdown.py)
    pin_whole: bool = False
    # the router's cores ("": anywhere); the benches run their client there too (client_here). On two
    # cores, anywhere puts the router and the client on decode's core too: its inter-token gaps then
    # measure them (bench/results/pd_ab_16_rig.md)
    load_cores: str = ""
    prefill: VllmProcess | None = None
    decode: VllmProcess | None = None
    router: RouterProcess | None = None
    restarts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENGINE_ROLES, 0))
    paused: set[str] = field(default_factory=set)
    killed_shm: set[str] = field(default_factory=set)  # /dev/shm files mapped by killed engines
    starting: set[str] = field(default_factory=set)  # roles being restarted (not healthy yet)

    def _server(self, role: str, cores: str, block_size: int | None) -> VllmProcess:
        connector = CONNECTORS[self.mode]
        spec = ServerSpec(
            model=self.model, port=free_port(), role=role, connector=connector, engine_id=f"{role}-0",
            side_port=free_port(), block_size=block_size, cores=cores, kv_cache_gib=self.kv_cache_gib,
            dtype=self.dtype, load_failure_policy=self.load_failure_policy,
            kv_events=self._kv_events(role),
            # Upstream baselines only; the kvferry connector owns its NIXL agent config.
            no_progress_thread=self.no_progress_thread and connector != "KvferryConnector",
            # kvferry defaults to LIBFABRIC (EFA); loopback on a CPU host is UCX.
            connector_extra=(
                {"backends": ["UCX"], **self.kvferry_extra} if connector == "KvferryConnector" else {}
            ),
        )  # fmt: skip
        return VllmProcess(spec, self.workdir / f"{role}.log")

    def _kv_events(self, role: str) -> tuple[str, str] | None:
        """The role's event endpoints: ipc sockets in the workdir (no port to race for, loopback only)."""
        if not self.kv_events:
            return None
        return (f"ipc://{self.workdir / role}.kv-events", f"ipc://{self.workdir / role}.kv-replay")

    def router_config(self) -> dict[str, Any]:
        assert self.prefill is not None and self.decode is not None
        entry = lambda p: {  # noqa: E731
            "url": p.url, "engine_id": p.spec.engine_id, "side_host": p.spec.host,
            "side_port": p.spec.side_port, "tp_size": 1, "revision": "r1",
            **dict(zip(("kv_events", "kv_events_replay"), p.spec.kv_events_urls(), strict=True)),
        }  # fmt: skip
        return {
            "mode": self.mode,
            "model": "tiny",
            "deadlines": self.deadlines,
            "discovery": {"static": {"prefill": [entry(self.prefill)], "decode": [entry(self.decode)]}},
            **self.router_extra,
        }

    def start(self, ready_timeout_s: float = 600.0) -> PdStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.prefill = self._server("prefill", ROLE_CORES["prefill"], self.prefill_block_size).start()
            self.decode = self._server("decode", ROLE_CORES["decode"], self.decode_block_size).start()
            # The router config is written after both are healthy: a lost port race may re-pick ports.
            self.prefill.wait_ready(ready_timeout_s, new_ports=True)
            self.decode.wait_ready(ready_timeout_s, new_ports=True)
            # NIXL's worker init re-pins the model thread to the last core; put each back on its own.
            self.prefill.pin(self.pin_whole)
            self.decode.pin(self.pin_whole)
            self.router = self._router()
            self.warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _router(self) -> RouterProcess:
        router = RouterProcess(self.router_config(), self.workdir).start()
        if self.load_cores:
            assert router.proc is not None
            pin_tree(router.proc.pid, parse_cores(self.load_cores))
        return router

    @contextlib.contextmanager
    def client_here(self) -> Iterator[None]:
        """Run the calling thread on load_cores meanwhile: a bench's client, in process or started from
        it (a child inherits its parent's cores)."""
        cores = parse_cores(self.load_cores) if self.load_cores else None
        before = os.sched_getaffinity(0)
        if cores:
            os.sched_setaffinity(0, cores)
        try:
            yield
        finally:
            if cores:
                os.sched_setaffinity(0, before)

    def reroute(self, deadlines: dict[str, float], router_extra: dict[str, Any] | None = None) -> None:
        """Replace the router with one of these deadlines and keys; the engines stay as they are."""
        if self.router is not None:
            self.router.stop()
        self.deadlines, self.router_extra = dict(deadlines), dict(router_extra or {})
        self.router = self._router()

    def revive(self, idle_timeout_s: float = 60.0) -> None:
        """A live, idle pair, whatever ran before: paused engines resumed, exited ones restarted (and
        handshaken again), then nothing running or queued on the engines or in flight on the router."""
        for role in list(self.paused):
            self.resume(role)
        for role in self.exited():
            self.restart(role)
            self.warm_up()
        self.settle_idle(idle_timeout_s)

    def settle_idle(self, timeout_s: float) -> None:
        start = time.monotonic()
        while (busy := self._busy()) and time.monotonic() - start < timeout_s:
            time.sleep(0.5)
        if busy:
            raise TimeoutError(f"P/D pair not idle after {timeout_s:g} s: {busy}")

    def _busy(self) -> dict[str, float]:
        """What still runs: requests on each engine, legs and detached prefills on the router."""
        try:
            out = {}
            for role in ENGINE_ROLES:
                m = self.server(role).metrics()
                out[role] = metric_sum(m, "vllm:num_requests_running") + metric_sum(
                    m, "vllm:num_requests_waiting"
                )
            assert self.router is not None
            r = self.router.metrics()
            out["router"] = metric_sum(r, "kvferry_router_in_flight") + metric_sum(
                r, "kvferry_router_detached_prefills"
            )
        except httpx.HTTPError as exc:
            return {"unreadable": 1.0, repr(exc): 1.0}
        return {k: v for k, v in out.items() if v}

    def warm_up(self) -> None:
        """One request end to end, so the first P<->D NIXL handshake is done before measurements.

        Upstream push loses registrations that arrive while its first handshake runs (observed: 4 of
        the first 11 requests at concurrency 4 waited forever); the router recovers those by
        recompute, but equality and bench runs should measure the steady state."""
        body = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 2, "temperature": 0}
        resp = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
        resp.raise_for_status()

    def stop(self) -> None:
        for role in list(self.paused):
            self.resume(role)  # a stopped process would sit out SIGTERM's grace time
        for part in (self.router, self.decode, self.prefill):
            if part is not None:
                part.stop()

    # -- faults (bench/soak.py) -------------------------------------------------------------------

    def server(self, role: str) -> VllmProcess:
        server = {"prefill": self.prefill, "decode": self.decode}[role]
        assert server is not None and server.proc is not None, f"{role} not started"
        return server

    def _signal(self, role: str, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server(role).proc.pid, sig)  # type: ignore[union-attr]

    def pause(self, role: str) -> None:
        """SIGSTOP the engine's process group: its sockets accept, nothing answers."""
        self.paused.add(role)
        self._signal(role, signal.SIGSTOP)

    def resume(self, role: str) -> None:
        self._signal(role, signal.SIGCONT)
        self.paused.discard(role)

    def kill(self, role: str) -> None:
        """SIGKILL the engine's whole process group (API server, engine core, workers) and reap it."""
        server = self.server(role)
        self.killed_shm |= tree_shm_files(server.proc.pid)  # type: ignore[union-attr]
        self._signal(role, signal.SIGKILL)
        self.paused.discard(role)
        server.stop()  # reaps the process, closes the log

    def restart(self, role: str, ready_timeout_s: float = 600.0) -> VllmProcess:
        """Kill the engine if it still runs, then start it again with the same spec (engine id, HTTP
        port, side channel) and wait until it is healthy; the router's static config stays valid."""
        old = self.server(role)
        if old.proc is not None and old.proc.poll() is None:
            self.kill(role)
        self.restarts[role] += 1
        new = VllmProcess(old.spec, self.workdir / f"{role}.{self.restarts[role]}.log")
        setattr(self, role, new)  # stop() reaches it from here on
        self.starting.add(role)
        new.start().wait_ready(ready_timeout_s)
        new.pin(self.pin_whole)
        self.starting.discard(role)
        return new

    def exited(self) -> list[str]:
        """Engines whose current process ended by itself (kill() and restart() replace a killed one)."""
        parts = {r: getattr(self, r) for r in ENGINE_ROLES}
        return [
            r for r, p in parts.items() if p is not None and p.proc is not None and p.proc.poll() is not None
        ]

    def pids(self) -> dict[str, int]:
        """Process id (= process group id) of the router and of each engine's current incarnation."""
        parts = {"router": self.router, "prefill": self.prefill, "decode": self.decode}
        return {k: v.proc.pid for k, v in parts.items() if v is not None and v.proc is not None}

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def gauges(self) -> dict[str, float]:
        """Every gauge that must be 0 when the stack is idle: ENGINE_GAUGES and kvferry_pending (summed
        per kind) on both engines' /metrics, ROUTER_GAUGES on the router's."""
        out: dict[str, float] = {}
        for role in ENGINE_ROLES:
            m = self.server(role).metrics()
            out.update({f"{role} {g}": metric_sum(m, g) for g in ENGINE_GAUGES})
            for key, value in m.items():
                if key.startswith("kvferry_pending{"):
                    kind = (re.search(r'kind="([^"]*)"', key) or [None, "?"])[1]
                    name = f"{role} kvferry_pending{{kind={kind}}}"
                    out[name] = out.get(name, 0.0) + value
        assert self.router is not None
        m = self.router.metrics()
        return out | {f"router {g}": metric_sum(m, g) for g in ROUTER_GAUGES}

    def engine_metrics(self, prefixes: tuple[str, ...]) -> dict[str, float]:
        """Non-zero series starting with one of `prefixes` on both engines ("role series"); an engine
        that does not answer is left out."""
        out: dict[str, float] = {}
        for role in ENGINE_ROLES:
            with contextlib.suppress(httpx.HTTPError):
                m = self.server(role).metrics()
                out |= {f"{role} {k}": v for k, v in m.items() if v and k.startswith(prefixes)}
        return out

    def settle(self, timeout_s: float) -> tuple[dict[str, float], float]:
        """Poll gauges() each second until all are 0 or timeout_s passed: the last reading, seconds."""
        start, last = time.monotonic(), {"unreadable": 1.0}
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                last = self.gauges()
            if not any(last.values()) or time.monotonic() - start > timeout_s:
                return last, time.monotonic() - start
            time.sleep(1.0)

    def orphan_shm(self) -> tuple[list[str], list[str]]:
        """/dev/shm files of killed engines that still exist: (mapped by no engine process alive,
        still mapped by a live engine, e.g. the peer's UCX mapping of a dead engine's segment)."""
        live: set[str] = set()
        for role in ENGINE_ROLES:
            server = getattr(self, role)
            if server is not None and server.proc is not None and server.proc.poll() is None:
                live |= tree_shm_files(server.proc.pid)
        left = {f for f in self.killed_shm if Path(f).exists()}
        return sorted(left - live), sorted(left & live)

    def remove_orphan_shm(self) -> int:
        """Unlink the killed engines' /dev/shm files no live engine maps (after stop(): all of them;
        only files this stack's own engines mapped). Returns the bytes they held."""
        freed = 0
        for f in self.orphan_shm()[0]:
            with contextlib.suppress(OSError):
                freed += Path(f).stat().st_blocks * 512
                Path(f).unlink()
        return freed


@dataclass
class MemoryWatch:
    """RSS (process plus children) of a stack's router, prefill and decode, per incarnation (pid)."""

    stack: PdStack
    samples: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # role -> pid -> bytes

    def sample(self) -> None:
        for role, pid in self.stack.pids().items():
            rss = 0 if role in self.stack.starting else tree_rss_bytes(pid)
            if rss:  # 0: killed meanwhile, or still starting
                self.samples.setdefault(role, {}).setdefault(pid, []).append(rss)

    def report(self) -> dict[str, dict[str, float]]:
        """MiB per role: first sample, peak, last sample; growth of the incarnation alive last, over
        its whole life and over the second half of its samples (warm-up excluded: a leak shows there).
        A restarted engine's first sample is its first after /health, before it served requests."""
        out = {}
        for role, incs in self.samples.items():
            first, last = next(iter(incs.values())), list(incs.values())[-1]
            out[role] = {
                "incarnations": len(incs), "start_mib": first[0] / 2**20,
                "peak_mib": max(max(i) for i in incs.values()) / 2**20, "end_mib": last[-1] / 2**20,
                "growth_mib": (last[-1] - last[0]) / 2**20,
                "late_growth_mib": (last[-1] - last[len(last) // 2]) / 2**20,
            }  # fmt: skip
        return out
