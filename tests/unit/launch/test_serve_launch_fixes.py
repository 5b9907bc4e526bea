"""vLLM launch: the server module instead of the `vllm` CLI, per-process core binding, bounded KV
space, offline hub, kv-transfer config per role and connector, and clear errors for bad specs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kvferry.connector.plugins.shm_wait import ENV_SHM_WAIT_SLEEP_S, sleep_from_env
from kvferry.connector.plugins.upstream_patches import ENV_NO_PROGRESS_THREAD
from kvferry.local.tinymodel import recipe, recipe_hash
from kvferry.tools.serve import (
    ServerSpec,
    VllmProcess,
    command,
    kv_transfer_config,
    parse_cores,
    server_env,
)


def spec(**kw: object) -> ServerSpec:
    base: dict[str, object] = {
        "model": Path("/m"),
        "port": 8100,
        "role": "prefill",
        "connector": "NixlPushConnector",
        "engine_id": "prefill-0",
        "side_port": 5600,
        "cores": "0",
    }
    return ServerSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_command_starts_the_server_module_on_loopback() -> None:
    cmd = command(spec(block_size=64), python="py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--block-size") + 1] == "64"
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "NixlPushConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "engine_id": "prefill-0",
    }
    assert "--kv-transfer-config" not in command(ServerSpec(model=Path("/m"), port=1), python="py")


def test_command_serves_the_model_in_its_dtype() -> None:
    def dtype_of(cmd: list[str]) -> str:
        return cmd[cmd.index("--dtype") + 1]

    assert dtype_of(command(spec(), python="py")) == "float32"  # the default, as before
    assert dtype_of(command(spec(dtype="bfloat16"), python="py")) == "bfloat16"
    assert dtype_of(command(ServerSpec(model=Path("/m"), port=1, dtype="float16"), python="py")) == "float16"


def test_kvferry_connector_gets_module_path_and_side_channel() -> None:
    config = kv_transfer_config(spec(role="decode", connector="KvferryConnector", engine_id="decode-0"))
    assert config is not None and config["kv_role"] == "kv_consumer"
    assert config["kv_connector_module_path"] == "kvferry.connector"
    assert config["kv_connector_extra_config"] == {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 5600,
    }


def test_env_binds_cores_bounds_kv_and_stays_offline() -> None:
    env = server_env(
        spec(cores="1", kv_cache_gib=2, no_progress_thread=True), base={ENV_NO_PROGRESS_THREAD: "0"}
    )
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env[ENV_NO_PROGRESS_THREAD] == "1"
    assert ENV_NO_PROGRESS_THREAD not in server_env(spec(), base={ENV_NO_PROGRESS_THREAD: "1"})


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"role": "router"}, "role 'router' is not one of"),
        ({"connector": None}, "a connector is needed exactly when"),
        ({"connector": "LMCache"}, "unknown connector 'LMCache'"),
        ({"side_port": None}, "needs engine_id and side_port"),
        ({"dtype": "fp8"}, "dtype 'fp8' is not one of"),
    ],
)
def test_bad_specs_fail_clearly(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**kw)


def test_core_lists_and_model_recipes() -> None:
    assert parse_cores("0") == {0} and parse_cores("0-2,5") == {0, 1, 2, 5}
    assert recipe_hash("llama") != recipe_hash("qwen")
    assert recipe("qwen")["config"]["architectures"] == ["Qwen2ForCausalLM"]
    with pytest.raises(ValueError, match="unknown arch 'gpt'"):
        recipe("gpt")


def test_cli_execs_the_server_module_with_model_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.tools import serve

    calls: list[tuple] = []
    monkeypatch.setattr(serve.os, "execvpe", lambda *args: calls.append(args))
    serve.main(["--cores", "1", "--no-progress-thread", "--", "/models/tiny", "--port", "8100"])
    _, argv, env = calls[0]
    assert argv[1:] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/tiny",
        "--port",
        "8100",
    ]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env[ENV_NO_PROGRESS_THREAD] == "1"
    with pytest.raises(SystemExit):
        serve.main(["--cores", "auto", "--", "/models/tiny"])


def test_env_makes_vllm_shm_queue_sleep_unless_the_caller_chose() -> None:
    assert server_env(spec(), base={})[ENV_SHM_WAIT_SLEEP_S] == "0.0001"
    assert server_env(spec(), base={ENV_SHM_WAIT_SLEEP_S: "0"})[ENV_SHM_WAIT_SLEEP_S] == "0"


@pytest.mark.parametrize(
    ("raw", "want"), [(None, None), ("0", None), ("", None), ("0.0001", 0.0001), ("0.01", 0.01)]
)
def test_shm_wait_sleep_parses(raw: str | None, want: float | None) -> None:
    assert sleep_from_env({} if raw is None else {ENV_SHM_WAIT_SLEEP_S: raw}) == want


@pytest.mark.parametrize(
    ("raw", "error"), [("fast", "not a number"), ("-1", "must be in"), ("0.5", "must be in")]
)
def test_shm_wait_sleep_rejects_bad_values_naming_the_variable(raw: str, error: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV_SHM_WAIT_SLEEP_S}=.*{error}"):
        sleep_from_env({ENV_SHM_WAIT_SLEEP_S: raw})


class _Scripted(VllmProcess):
    """wait_ready's restart logic with the process side scripted: each attempt dies with `deaths`."""

    def __init__(self, deaths: list[str]) -> None:
        super().__init__(ServerSpec(model=Path("/m"), port=1))
        self.deaths, self.log, self.starts, self.stops = deaths, "", 0, 0

    def start(self) -> VllmProcess:
        self.starts += 1
        return self

    def stop(self, grace_s: float = 20.0) -> None:
        self.stops += 1

    def log_tail(self, chars: int = 3000) -> str:
        return self.log

    def _wait_healthy(self, timeout_s: float) -> VllmProcess:
        if self.deaths:
            self.log = self.deaths.pop(0)
            raise RuntimeError(f"vLLM single exited with 1: {self.log}")
        return self


def test_a_server_that_lost_a_port_race_is_restarted_once() -> None:
    server = _Scripted(["zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')"])
    assert server.wait_ready(1) is server and (server.stops, server.starts) == (1, 1)


def test_other_deaths_and_a_second_port_race_are_raised() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        _Scripted(["no CUDA"]).wait_ready(1)
    twice = _Scripted(["Address already in use", "Address already in use"])
    with pytest.raises(RuntimeError, match="Address already in use"):
        twice.wait_ready(1)
    assert twice.starts == 1


def test_a_lost_port_race_with_new_ports_repicks_the_http_and_side_ports() -> None:
    server = _Scripted(["Address already in use"])
    server.spec = ServerSpec(model=Path("/m"), port=1, side_port=2)
    server.wait_ready(1, new_ports=True)
    assert server.spec.port not in (1, 2) and server.spec.side_port not in (1, 2, None)


def test_a_server_hanging_after_a_lost_port_race_is_caught_while_it_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream push's side-channel listener dies on a taken port and leaves vLLM running, unhealthy."""
    from kvferry.tools import serve

    monkeypatch.setattr(serve, "LOG_SCAN_EVERY_S", 0.0)
    log = tmp_path / "prefill.log"
    log.write_text("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5600')\n")
    server = VllmProcess(ServerSpec(model=Path("/m"), port=serve.free_port()), log)
    server.proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(RuntimeError, match="lost a port race"):
            server._wait_healthy(20)
        assert server.proc.poll() is None  # still running: only the log told
    finally:
        server.proc.kill()
        server.proc.wait()
