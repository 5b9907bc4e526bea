"""Launch step: start vLLM-CPU servers with kvferry's launch fixes, from the CLI or from Python.

Fixes applied in code, not with a sitecustomize shim:
- `vllm serve` looks up the distribution "vllm", but the CPU build is `vllm-cpu`: we start the
  server module (`python -m vllm.entrypoints.openai.api_server`) instead of the CLI.
- `VLLM_CPU_OMP_THREADS_BIND` is set per process (`auto` reserves cores a 2-core host does not
  have and runs ~10x slower), `VLLM_CPU_KVCACHE_SPACE` bounds the KV cache, the hub is offline.
- NIXL's CPU worker init re-pins the worker's main thread to the last core; `VllmProcess.pin()`
  moves the worker back onto its cores once the server is up.
- vLLM's engine<->worker shared-memory queue spins on sched_yield for 1 s after every message, which
  on a small host starves the API servers and the other engine: `KVFERRY_SHM_WAIT_SLEEP_S` makes
  it sleep 0.1 ms per check instead (shm_wait.py; an explicit value in the environment wins).
- Opt-in `no_progress_thread` turns off the UCX progress thread of upstream NIXL connectors (a
  patch of upstream behaviour, see upstream_patches.py).

    kvferry serve [--cores 0] [--kv-cache-gib 1] [--no-progress-thread] -- MODEL --port 8100 ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import httpx
from kvferry.connector.plugins.shm_wait import DEFAULT_SLEEP_S, ENV_SHM_WAIT_SLEEP_S
from kvferry.connector.plugins.upstream_patches import ENV_NO_PROGRESS_THREAD
from kvferry.contracts.promtext import metric_sum, parse_metrics

__all__ = ["ServerSpec", "VllmProcess", "free_port", "metric_sum", "parse_metrics"]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ROLES = ("single", "prefill", "decode")
PORT_TAKEN = "Address already in use"
LOG_SCAN_CHARS = 20000  # a start-up traceback and vLLM's shutdown noise after it
LOG_SCAN_EVERY_S = 5.0  # how often a starting server's log is checked for a lost port race
UPSTREAM_CONNECTORS = ("NixlConnector", "NixlPushConnector")
KVFERRY_CONNECTOR = "KvferryConnector"
# --dtype values; "auto" serves a float32 checkpoint as bfloat16 on CPU (vLLM downcasts float32).
DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class ServerSpec:
    """One vLLM server: model, role in a P/D pair, connector and the CPU resources it may use."""

    model: Path
    port: int
    role: str = "single"
    connector: str | None = None
    engine_id: str | None = None
    side_port: int | None = None
    block_size: int | None = None
    cores: str = "0"
    dtype: str = "float32"  # --dtype; the model's own dtype (tinymodel.Shape.dtype), see DTYPES
    kv_cache_gib: float = 1.0
    max_model_len: int = 2048
    served_name: str = "tiny"
    host: str = "127.0.0.1"
    no_progress_thread: bool = False
    load_failure_policy: str = "fail"  # kv_load_failure_policy: what D does when its KV never arrives
    prefix_caching: bool = True  # vLLM's prefix cache, on as in the operator's default (both roles)
    connector_extra: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    # vLLM's KV-cache events (`--kv-events-config`): where it publishes the stream and its replay
    # buffer, ZMQ endpoints it binds; None: not published. Local stacks use ipc:// paths: vLLM binds a
    # tcp endpoint only on a wildcard address (`tcp://*:port`, every interface), and connects otherwise.
    kv_events: tuple[str, str] | None = None

    def kv_events_urls(self) -> tuple[str, str]:
        """Where the router reaches the event stream and its replay buffer ("" when not published)."""
        return self.kv_events or ("", "")

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if (self.role == "single") != (self.connector is None):
            raise ValueError("a connector is needed exactly when role is prefill or decode")
        if self.connector is not None:
            if self.connector not in (*UPSTREAM_CONNECTORS, KVFERRY_CONNECTOR):
                raise ValueError(f"unknown connector {self.connector!r}")
            if not self.engine_id or not self.side_port:
                raise ValueError(f"{self.role} server needs engine_id and side_port")
        if self.load_failure_policy not in ("fail", "recompute"):
            raise ValueError(f"load_failure_policy {self.load_failure_policy!r} is not fail or recompute")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def kv_transfer_config(spec: ServerSpec) -> dict[str, Any] | None:
    """The --kv-transfer-config JSON for a P/D role (docs/contracts.md §3)."""
    if spec.connector is None:
        return None
    config: dict[str, Any] = {
        "kv_connector": spec.connector,
        "kv_role": "kv_producer" if spec.role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": spec.engine_id,
    }
    if spec.role == "decode":  # only a consumer loads KV
        config["kv_load_failure_policy"] = spec.load_failure_policy
    extra = dict(spec.connector_extra)
    if spec.connector == KVFERRY_CONNECTOR:
        config["kv_connector_module_path"] = "kvferry.connector"
        extra.setdefault("side_channel_host", spec.host)
        extra.setdefault("side_channel_port", spec.side_port)
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def command(spec: ServerSpec, python: str = sys.executable) -> list[str]:
    cmd = [python, "-m", SERVER_MODULE, "--model", str(spec.model), "--served-model-name", spec.served_name]
    cmd += ["--host", spec.host, "--port", str(spec.port), "--dtype", spec.dtype]
    cmd += ["--max-model-len", str(spec.max_model_len), "--enforce-eager"]
    cmd.append("--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching")
    if spec.block_size is not None:
        cmd += ["--block-size", str(spec.block_size)]
    config = kv_transfer_config(spec)
    if config is not None:
        cmd += ["--kv-transfer-config", json.dumps(config)]
    if spec.kv_events is not None:
        cmd += ["--kv-events-config", json.dumps(kv_events_config(*spec.kv_events))]
    return cmd + list(spec.extra_args)


def kv_events_config(endpoint: str, replay_endpoint: str) -> dict[str, Any]:
    """vLLM's --kv-events-config: publish what the prefix cache stores and evicts (router/kvfeed.py)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "topic": "kv-events",
    }


def launch_env(
    cores: str, kv_cache_gib: float, no_progress_thread: bool, base: dict[str, str] | None = None
) -> dict[str, str]:
    """Environment for one vLLM process: pinned OMP threads, bounded KV cache, hub offline."""
    env = dict(os.environ if base is None else base)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=cores,
        VLLM_CPU_KVCACHE_SPACE=f"{kv_cache_gib:g}",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",  # logs reach the file as they happen, not at exit
        VLLM_HOST_IP="127.0.0.1",  # vLLM's internal sockets stay on loopback too
    )
    env.setdefault(ENV_SHM_WAIT_SLEEP_S, f"{DEFAULT_SLEEP_S:g}")
    if no_progress_thread:
        env[ENV_NO_PROGRESS_THREAD] = "1"
    else:
        env.pop(ENV_NO_PROGRESS_THREAD, None)
    return env


def server_env(spec: ServerSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    env = launch_env(spec.cores, spec.kv_cache_gib, spec.no_progress_thread, base)
    if spec.side_port is not None:
        # Bound and advertised by upstream NIXL connectors: must be the address peers dial.
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=spec.host, VLLM_NIXL_SIDE_CHANNEL_PORT=str(spec.side_port))
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def parse_cores(cores: str) -> set[int]:
    """'0', '0-1' or '0,2' -> {0, ...}."""
    result: set[int] = set()
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        result.update(range(int(lo), int(hi or lo) + 1))
    return result


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name (state, ppid, ...), or None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pin_tree(pid: int, cores: set[int], only: str = "") -> int:
    """Move every thread of a process and its descendants (only: those whose name contains it) onto
    `cores`; returns threads moved."""
    moved = 0
    for p in [pid, *_descendants(pid)]:
        try:
            if only and only not in Path(f"/proc/{p}/comm").read_text():
                continue
            for task in Path(f"/proc/{p}/task").iterdir():
                os.sched_setaffinity(int(task.name), cores)
                moved += 1
        except (OSError, ValueError):
            continue  # a thread or process ended meanwhile
    return moved


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (fields := _stat_fields(entry.name)) is None:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class VllmProcess:
    """A vLLM server in its own process group: start, wait for /health, scrape, stop by PID."""

    def __init__(self, spec: ServerSpec, log_path: Path | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    def command_line(self) -> list[str]:
        return command(self.spec)

    def environment(self) -> dict[str, str]:
        return server_env(self.spec)

    def start(self) -> VllmProcess:
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command_line(),
            env=self.environment(),
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() reaches engine core and workers
        )
        return self

    def wait_ready(self, timeout_s: float = 600.0, *, new_ports: bool = False) -> VllmProcess:
        """Poll /health until 200; raise with the log tail if the process dies or time runs out.

        Restarts once when vLLM lost a port race: servers starting at once can pick the same free port
        (seen in CI: `ZMQError: Address already in use`). vLLM's own ZMQ sockets make it exit; an
        upstream connector's side-channel listener thread dies and leaves the server hanging, so the
        log is watched while waiting too. A second start picks vLLM's internal ports again, and with
        `new_ports` (nothing has been told this server's ports yet) its HTTP and side ports as well."""
        try:
            return self._wait_healthy(timeout_s)
        except RuntimeError:
            if PORT_TAKEN not in self.log_tail(LOG_SCAN_CHARS):
                raise
        self.stop()
        if new_ports:
            side = free_port(self.spec.host) if self.spec.side_port is not None else None
            self.spec = replace(self.spec, port=free_port(self.spec.host), side_port=side)
        return self.start()._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> VllmProcess:
        assert self.proc is not None, "start() first"
        deadline, next_scan = time.monotonic() + timeout_s, time.monotonic() + LOG_SCAN_EVERY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM {self.spec.role} exited with {self.proc.returncode}: {self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + LOG_SCAN_EVERY_S
                if PORT_TAKEN in self.log_tail(LOG_SCAN_CHARS):
                    raise RuntimeError(f"vLLM {self.spec.role} lost a port race: {self.log_tail()}")
            time.sleep(0.5)
        raise TimeoutError(f"vLLM {self.spec.role} not healthy after {timeout_s:.0f}s: {self.log_tail()}")

    def pin(self, whole: bool = False) -> int:
        """Move every thread of the server's worker processes (whole: of all its processes, the API
        server and engine core too, as a pod's CPU set would hold them) onto spec.cores; returns
        threads moved."""
        assert self.proc is not None
        return pin_tree(self.proc.pid, parse_cores(self.spec.cores), only="" if whole else "Worker")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the server and all its children."""
        assert self.proc is not None
        tick, total = os.sysconf("SC_CLK_TCK"), 0
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            if (fields := _stat_fields(pid)) is not None:  # None: ended meanwhile
                total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def thread_cpu_seconds(self) -> dict[str, float]:
        """CPU time per thread name ("pid/name", summed over threads of one name) of the server's tree:
        where the time of cpu_seconds() went."""
        assert self.proc is not None
        tick, out = os.sysconf("SC_CLK_TCK"), {}
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    name, fields = (
                        stat[stat.index("(") + 1 : stat.rindex(")")],
                        stat.rsplit(")", 1)[1].split(),
                    )
                    key = f"{pid}/{name}"
                    out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        return out

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10.0).text)

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL it after grace_s."""
        if self.proc is not None and self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc is not None:
            # Engine-core or worker children can outlive the API server; the group reaches them.
            _signal_group(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmProcess:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()  # __exit__ does not run when __enter__ raises
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvferry serve",
        description=__doc__.splitlines()[0],
        usage="%(prog)s [options] -- MODEL [vllm args]",
    )
    parser.add_argument("--cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND value (never 'auto')")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument(
        "--no-progress-thread",
        action="store_true",
        help="patch upstream NIXL connectors to run without the UCX progress thread",
    )
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="MODEL then vLLM server arguments")
    args = parser.parse_args(argv)
    rest = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    if args.cores == "auto":
        parser.error("--cores auto reserves cores a small host does not have; give explicit cores")
    if rest and not rest[0].startswith("-"):
        rest = ["--model", *rest]  # `vllm serve MODEL ...` style
    if "--model" not in rest:
        parser.error("give the model folder: kvferry serve -- MODEL [vllm args]")
    env = launch_env(args.cores, args.kv_cache_gib, args.no_progress_thread)
    os.execvpe(sys.executable, [sys.executable, "-m", SERVER_MODULE, *rest], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
