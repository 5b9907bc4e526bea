"""Scale-down under load loses no request: the leaving pod leaves the router's pool first, drains, then
stops (docs/scaling-and-drain.md).

Real parts: the API server, the StatefulSet and EndpointSlice controllers, the kvferry operator (its
rendered preStop, --shutdown-timeout and grace period), the node agent running the pods as processes
(preStop, SIGTERM to the main process, grace period, final delete), and the router with its
Kubernetes discovery, as its own ServiceAccount. The engine is a stand-in (`drain_engine.py`): what is
under test is the Kubernetes and router sequence, not the KV path, and a real vLLM per pod would not
fit four pods in CI time. It behaves as vLLM's --shutdown-timeout drain does (refuse new requests,
finish those in flight, exit) and logs every arrival, the SIGTERM and its exit. The same sequence with
real vLLM pods runs in bench/autoscale_bench.py (its scale-in phase).

Both roles go 2 -> 1 at once while four clients keep streaming 12 s completions through the router.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.local.controlplane.processes import reserve_ports
from kvferry.operator.spec import names

from tests.cluster import agent_nodes
from tests.cluster.drain_engine import TOKEN_S
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

NAME = "drain"
TAINT = "kvferry.io/drain-test"
TOKENS = 48  # x TOKEN_S = 12 s per request: longer than the preStop sleep, so SIGTERM finds work
CLIENTS = 4
PRESTOP_S = 10.0  # operator/render: PRESTOP_SECONDS
DECODE_DRAIN_S, PREFILL_DRAIN_S = 30, 10
STAND_IN = Path(__file__).with_name("drain_engine.py")


@pytest.fixture
def drain_node(control_plane, admin_api, tmp_path) -> Iterator[tuple[str, Path]]:
    """A tainted Node run by a node agent whose `vllm` is the stand-in engine; its events directory."""
    events = tmp_path / "events"
    events.mkdir()
    engine = ["env", f"DRAIN_EVENTS={events}", sys.executable, str(STAND_IN)]
    plane = control_plane.kubeconfig
    with agent_nodes.agent_node(plane, admin_api, "drain", TAINT, vllm=engine) as (name, _):
        yield name, events


def _role(node: str, drain_s: int) -> dict[str, Any]:
    return {
        "replicas": 2,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": [{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
        "shutdownTimeoutSeconds": drain_s,
    }


@pytest.fixture
def start_router(cluster, tmp_path) -> Iterator[Callable[[], str]]:
    """Factory: `kvferry router` with the CR's rendered config, as the router's ServiceAccount, on
    127.0.0.1 (the router pod itself runs on a kwok node); returns its URL."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> str:
        cm = cluster.get("configmap", f"{NAME}-config")
        assert cm is not None
        config = tmp_path / "router.yaml"
        config.write_text(cm["data"]["router.yaml"])
        kubeconfig = cluster.plane.sa_kubeconfig(cluster.ns, names.router_name(NAME), create=False)
        port = reserve_ports(1)[0]
        argv = [sys.executable, "-m", "kvferry.router.cli", "--config", str(config)]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        with (tmp_path / "router.log").open("wb") as log:
            env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def _router_metrics(url: str) -> dict[str, Any]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=5).text)


def _engines(url: str) -> tuple[float, float]:
    m = _router_metrics(url)
    role = lambda r: metric_sum(m, "kvferry_router_engines", role=r)  # noqa: E731
    return role("prefill"), role("decode")


@dataclass
class Load:
    """CLIENTS threads streaming completions through the router until stopped."""

    url: str
    results: list[tuple[bool, int, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                n += 1
                body = {"prompt": f"client {i} request {n}", "max_tokens": TOKENS, "stream": True}
                tokens, error = 0, ""
                try:
                    with http.stream("POST", self.url + "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                        for line in resp.iter_lines():
                            if line.startswith("data: {"):
                                tokens += len(json.loads(line[6:])["choices"][0]["text"])
                except httpx.HTTPError as exc:
                    error = repr(exc)
                self.results.append((not error and tokens == TOKENS, tokens, error))


class DropWatch(threading.Thread):
    """Records when the router's pool first holds fewer than two engines of each role."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.dropped, self.done = url, {}, threading.Event()

    def run(self) -> None:
        while not self.done.is_set() and len(self.dropped) < 2:
            try:
                counts = dict(zip(("prefill", "decode"), _engines(self.url), strict=True))
            except httpx.HTTPError:
                counts = {}
            for role, n in counts.items():
                if n < 2 and role not in self.dropped:
                    self.dropped[role] = time.time()
            time.sleep(0.1)


def _events(directory: Path, pod: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (directory / f"{pod}.jsonl").read_text().splitlines()]


def test_scale_down_under_load_leaves_the_router_first_then_drains(
    cluster, operator, drain_node, start_router
) -> None:
    node, events = drain_node
    cr = make_inference(NAME).prefill(**_role(node, PREFILL_DRAIN_S)).decode(**_role(node, DECODE_DRAIN_S))
    cluster.apply(cr.obj())
    cluster.wait_ready(NAME, "four stand-in engine pods Ready on the node agent's node")
    router = start_router()
    wait_until(lambda: _engines(router), "the router's pool: 2 prefill, 2 decode",
               until=lambda c: c == (2, 2), ignore=(httpx.HTTPError,))  # fmt: skip

    load = Load(router)
    clients = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in clients:
        t.start()
    leaving = {"prefill": f"{NAME}-prefill-1", "decode": f"{NAME}-decode-1"}
    wait_until(lambda: (events / f"{leaving['decode']}.jsonl").read_text().count('"arrive"') >= 2,
               "requests streaming on the decode pod that will leave")  # fmt: skip

    watch = DropWatch(router)
    watch.start()
    t_scale = time.time()
    one = {"spec": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}
    cluster.kubectl("patch", "disaggregatedinference", NAME, "--type=merge", "-p", json.dumps(one))
    present = lambda: {p["metadata"]["name"] for p in cluster.pods(NAME)}  # noqa: E731
    wait_until(lambda: not set(leaving.values()) & present(), "both leaving pods removed from the API",
               timeout_s=PRESTOP_S + DECODE_DRAIN_S + 60)  # fmt: skip
    t_gone = time.time()
    load.stop.set()
    for t in clients:
        t.join(timeout=TOKENS * TOKEN_S + 30)
    watch.done.set()

    lost = [r for r in load.results if not r[0]]
    assert load.results and not lost, f"{len(lost)} of {len(load.results)} requests lost: {lost[:5]}"
    m = _router_metrics(router)
    assert metric_sum(m, "kvferry_router_leg_errors_total") == 0, "a leg failed (and was recomputed)"
    assert metric_sum(m, "kvferry_router_recomputes_total") == 0

    for role, pod in leaving.items():
        evs = _events(events, pod)
        seen = {e["ev"]: round(e["t"] - t_scale, 2) for e in evs if e["ev"] in ("sigterm", "exit")}
        drop = round(watch.dropped.get(role, float("nan")) - t_scale, 2)
        print(f"{pod}: router dropped it at +{drop}s, then {seen}, gone by +{t_gone - t_scale:.1f}s",
              f"({len(load.results)} requests, none lost)", file=sys.stderr)  # fmt: skip
        term = next(e for e in evs if e["ev"] == "sigterm")
        exit_ = next(e for e in evs if e["ev"] == "exit")
        arrivals = [e["t"] for e in evs if e["ev"] == "arrive"]
        finishes = [e for e in evs if e["ev"] == "finish"]
        dropped = watch.dropped.get(role)
        # 1. out of the router's pool first, before its engine was told to stop
        assert dropped is not None and t_scale < dropped < term["t"], (role, t_scale, dropped, term)
        assert max(arrivals) < term["t"] and not [e for e in evs if e["ev"] == "refused"], role
        # 2. the preStop sleep kept it serving while the router's view caught up
        assert term["t"] - t_scale >= PRESTOP_S - 1, (role, term["t"] - t_scale)
        # 3. it drained: everything it accepted finished whole, then it exited, then the pod went
        assert all(e["ok"] for e in finishes) and len(finishes) == len(arrivals), role
        assert exit_["in_flight"] == 0 and max(e["t"] for e in finishes) <= exit_["t"] < t_gone, role
    # The decode pod had streams in flight at its SIGTERM: the drain carried real work.
    assert next(e for e in _events(events, leaving["decode"]) if e["ev"] == "sigterm")["in_flight"] > 0
    # The pods that stay served on: requests arrived there after the scale-down began.
    for pod in (f"{NAME}-prefill-0", f"{NAME}-decode-0"):
        assert any(e["ev"] == "arrive" and e["t"] > t_scale + PRESTOP_S for e in _events(events, pod)), pod
