"""Operator benchmark: kubectl apply -> all objects present -> Ready under kwok, for 1 and for N CRs;
operator memory after N CRs; Kubernetes API requests per reconcile (from the operator's own metrics).

Runs a private control plane (real apiserver/etcd/KCM/scheduler, kwok nodes) and `kvferry operator` as a
subprocess; prints figures, asserts nothing about time. Everything started here is stopped by PID.

    python bench/operator_bench.py [--crs 200] [--cpu-nodes 7]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml
from kubernetes import client
from kvferry.local.controlplane import ControlPlane
from kvferry.local.controlplane.processes import reserve_ports
from kvferry.operator import names
from kvferry.operator.apply import RENDERED_KINDS, Kube
from kvferry.operator.render.objects import render
from kvferry.operator.spec import GROUP, PLURAL, VERSION

ROOT = Path(__file__).resolve().parents[1]
NS = "bench"
POLL_S = 0.1


def cr(name: str) -> dict:
    # No preset and no resources: pods schedule on any untainted kwok node (what is measured is the operator).
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DisaggregatedInference",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": "/models/tiny", "accelerator": "none", "image": "bench:1"},
    }


def count_objects(api: client.ApiClient) -> int:
    """Managed objects in the namespace, counted with raw list calls (one per kind)."""
    total = 0
    for kind in RENDERED_KINDS:
        path = f"{Kube.path(kind, NS)}?labelSelector={names.LABEL_MANAGED_BY}%3D{names.MANAGED_BY}"
        data = api.call_api(*api.param_serialize("GET", path, auth_settings=["BearerToken"]))
        data.read()
        total += len(json.loads(data.data)["items"])
    return total


def count_ready(custom: client.CustomObjectsApi) -> int:
    items = custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"]
    ready = 0
    for item in items:
        st = item.get("status", {})
        cond = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
        ready += (
            cond.get("status") == "True" and st.get("observedGeneration") == item["metadata"]["generation"]
        )
    return ready


def wait(pred, what: str, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return time.monotonic() - t0


def operator_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvferry_operator_") and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def requests_and_reconciles(metrics: dict[str, float]) -> tuple[float, dict[str, float]]:
    requests = sum(v for k, v in metrics.items() if k.startswith("kvferry_operator_api_requests_total"))
    reconciles: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith("kvferry_operator_reconciles_total"):
            trigger = key.split('trigger="')[1].split('"')[0]
            reconciles[trigger] = reconciles.get(trigger, 0) + value
    return requests, reconciles


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def apply(plane: ControlPlane, objs: list[dict]) -> None:
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs), timeout_s=1200)


def run(n: int, cpu_nodes: int, workdir: Path) -> None:
    plane = ControlPlane({"cpu": cpu_nodes})
    operator: subprocess.Popen | None = None
    try:
        plane.start(workdir / "plane")
        plane.kubectl("apply", "--server-side", "-f", str(ROOT / "crds/disaggregatedinferences.yaml"))
        plane.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=60s")
        plane.kubectl("create", "namespace", NS)
        (port,) = reserve_ports(1)
        log = (workdir / "operator.log").open("wb")
        env = {
            **os.environ,
            "KVFERRY_METRICS_PORT": str(port),
            "KVFERRY_METRICS_HOST": "127.0.0.1",
            # kwok pods serve nothing and their IPs are not ours to reach: scrape a closed loopback port
            # (the timer's cost stays in the figures; no traffic leaves the host).
            "KVFERRY_METRICS_URL": "http://127.0.0.1:9/{pod}",
        }
        operator = subprocess.Popen(
            [
                shutil.which("kvferry") or "kvferry",
                "operator",
                "--standalone",
                "-n",
                NS,
                "--kubeconfig",
                str(plane.kubeconfig),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        wait(lambda: _up(port), "operator metrics endpoint", 60)
        rss_idle = rss_mib(operator.pid)
        with plane.admin_client() as api:
            custom = client.CustomObjectsApi(api)
            print(f"operator RSS idle: {rss_idle:.0f} MiB")
            for label, crs in (("1 CR", [cr("one")]), (f"{n} CRs", [cr(f"b-{i:03d}") for i in range(n)])):
                before_objects = count_objects(api)
                before_ready = count_ready(custom)
                req0, rec0 = requests_and_reconciles(operator_metrics(port))
                t0 = time.monotonic()
                apply(plane, crs)
                t_apply = time.monotonic() - t0
                want_objects = before_objects + len(render(cr("x")).objects) * len(crs)
                wait(lambda w=want_objects: count_objects(api) >= w, "objects", 900)
                t_objects = time.monotonic() - t0
                want_ready = before_ready + len(crs)
                wait(lambda w=want_ready: count_ready(custom) >= w, "Ready", 1800)
                t_ready = time.monotonic() - t0  # every figure counts from the start of kubectl apply
                time.sleep(2)  # let trailing status events settle before counting
                req1, rec1 = requests_and_reconciles(operator_metrics(port))
                full = sum(
                    rec1.get(k, 0) - rec0.get(k, 0) for k in ("create", "update", "resume", "resync", "drift")
                )
                owned = rec1.get("owned", 0) - rec0.get("owned", 0)
                print(
                    f"[{label}] kubectl apply returned after {t_apply:.2f} s; all objects present after "
                    f"{t_objects:.2f} s; all Ready after {t_ready:.2f} s"
                )
                print(
                    f"[{label}] API requests by the operator: {req1 - req0:.0f}; full reconciles: {full:.0f} "
                    f"({(req1 - req0) / max(full, 1):.1f} req per full reconcile, refreshes included); "
                    f"owned-object events handled: {owned:.0f}"
                )
            print(
                f"operator RSS after {n + 1} CRs: {rss_mib(operator.pid):.0f} MiB (idle {rss_idle:.0f} MiB)"
            )
            m = operator_metrics(port)
            by_kind: dict[str, float] = {}
            for key, value in m.items():
                if key.startswith("kvferry_operator_api_requests_total"):
                    verb = key.split('verb="')[1].split('"')[0]
                    kind = key.split('kind="')[1].split('"')[0]
                    by_kind[f"{verb} {kind}"] = by_kind.get(f"{verb} {kind}", 0) + value
            print("API requests by verb and kind:", json.dumps(dict(sorted(by_kind.items())), indent=None))
    finally:
        if operator is not None and operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(20)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait(10)
        plane.stop()


def _up(port: int) -> bool:
    try:
        operator_metrics(port)
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crs", type=int, default=200, help="CRs in the bulk phase")
    p.add_argument("--cpu-nodes", type=int, default=7, help="kwok cpu nodes (110 pods each; 3 pods per CR)")
    args = p.parse_args(argv)
    if args.crs * 3 + 3 > args.cpu_nodes * 110:
        p.error(
            f"{args.crs} CRs need {args.crs * 3 + 3} pods; {args.cpu_nodes} nodes hold {args.cpu_nodes * 110}"
        )
    # SIGTERM unwinds like Ctrl-C, so the operator and the control plane are stopped (by PID) too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="kvferry-opbench-") as tmp:
        run(args.crs, args.cpu_nodes, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
