"""`kvferry operator` and `kvferry router` from the built wheel, installed non-editable into a clean venv,
against the real API server: the operator (as its ServiceAccount, with the shipped RBAC) reconciles a
p5en CR to Ready on the kwok nodes, and the router, with the config the operator rendered and the
router's own ServiceAccount, finds the CR's engines through their EndpointSlices and answers /health."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from kvferry.local.controlplane.processes import reserve_ports
from kvferry.operator.spec import names

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until
from tests.wheel import wheelkit

pytestmark = pytest.mark.cluster

ROUTER_HEALTH_TIMEOUT_S = 60.0
# Unset in the processes started from the wheel: nothing may point them at the checkout or the dev venv.
NOT_INHERITED: dict[str, str | None] = {"PYTHONPATH": None, "PYTHONHOME": None, "PYTHONNOUSERSITE": "1"}


def _health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 until both roles have a ready engine
        return json.loads(exc.read() or b"{}") | {"http": exc.code}
    except OSError:
        return None


def _router(wheel_venv, config: Path, kubeconfig: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = reserve_ports(1)[0]
    env = {**wheelkit.clean_env(wheel_venv.venv), "KUBECONFIG": str(kubeconfig)}
    argv = [str(wheel_venv.kvferry), "router", "--config", str(config), "--host", "127.0.0.1"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent
        )
    return proc, f"http://127.0.0.1:{port}/health"


def test_operator_and_router_from_the_wheel_serve_a_cr(
    cluster, start_operator, wheel_venv, tmp_path: Path
) -> None:
    shebang = wheel_venv.kvferry.read_text().splitlines()[0]
    assert shebang == f"#!{wheel_venv.python}", shebang  # the console script runs the clean venv's Python
    operator = start_operator(
        "--metrics-interval",
        "1",
        "--metrics-url",
        "http://127.0.0.1:9/{pod}",
        exe=str(wheel_venv.kvferry),
        env={**NOT_INHERITED, "VIRTUAL_ENV": str(wheel_venv.venv)},
    )
    cr = make_inference("whl", accelerator="p5en").prefill(tensorParallelSize=2).decode(tensorParallelSize=4)
    cluster.apply(cr.obj())
    cluster.wait_ready("whl", "CR whl Ready, reconciled by the operator from the wheel")
    status = cluster.cr("whl")["status"]
    assert (status["prefill"]["summary"], status["decode"]["summary"]) == ("1/1", "1/1")
    assert operator.proc.poll() is None, operator.text()[-3000:]

    rendered = cluster.get("configmap", names.config_name("whl"))
    assert rendered, "the operator rendered no router config"
    config = tmp_path / "router.yaml"
    config.write_text(rendered["data"]["router.yaml"])
    assert yaml.safe_load(config.read_text())["discovery"]["kubernetes"]["namespace"] == cluster.ns
    sa = cluster.plane.sa_kubeconfig(cluster.ns, names.router_name("whl"), create=False)
    log = tmp_path / "router.log"
    proc, url = _router(wheel_venv, config, sa, log)
    try:

        def both_roles() -> dict | None:
            if proc.poll() is not None:
                raise AssertionError(f"router exited {proc.returncode}: {log.read_text()[-3000:]}")
            body = _health(url)
            return body if body and body.get("status") == "ok" else None

        body = wait_until(both_roles, "router /health ok with both roles", ROUTER_HEALTH_TIMEOUT_S)
        assert (body["prefill"], body["decode"]) == (1, 1)
        assert body["revisions"] == [status["revision"]]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
