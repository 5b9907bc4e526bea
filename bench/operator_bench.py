"""Operator benchmark: N CRs applied at once under kwok, the current operator (also at an older git
revision) and the control plane's floor side by side in one run (each on a fresh control plane, same
N, same nodes):

- time from the first CR's creation (8 concurrent clients) to all objects present, and to all CRs Ready;
- full reconciles per CR (create/update/resume/resync/drift), API requests per full reconcile and per CR;
- the operator's peak memory (VmHWM), and per CR above its idle RSS;
- with --shards N, each operator design also runs as N replicas with KVFERRY_SHARD=i/N (a column of
  its own, "after, 2 shards"): requests, reconciles, CPU and peak memory are summed over the replicas,
  and each replica's peak is shown too;
- CPU seconds of the API server, the controller-manager and the operator (or floor client) meanwhile;
- status lag: seconds from a transfer-metrics change of one CR (a local metrics server stands in for its
  engines, or for its router) to that CR's status showing it.

"after" is the operator with its default settings; "after@REV" is the same with the operator's code at
git REV (to compare a change side by side). The figures of the design before fleet-scale reconciles
are frozen in bench/results/operator_bench_before.md. "floor" runs no operator: a plain client (a
subprocess, 8 threads, as the operator's 8 reconcile threads) creates, for each CR as its create
returns, exactly the objects the operator renders (operator/render), one create request per object as
the operator's first reconcile does; a CR counts as Ready when its StatefulSets and Deployment have
readyReplicas == replicas. Runs a private control plane (real apiserver/etcd/KCM/scheduler, kwok nodes)
and `kvferry operator` as a subprocess; prints figures, asserts nothing about time. Everything started
here is stopped by PID.

    python bench/operator_bench.py [--crs 1000] [--designs floor,after,after@REV] [--shards 2] [--timeout 900]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes import client
from kvferry.local.controlplane import ControlPlane
from kvferry.local.controlplane.processes import reserve_ports
from kvferry.operator.reconcile.apply import RENDERED_KINDS, Kube, KubeError
from kvferry.operator.render.objects import render
from kvferry.operator.spec import GROUP, PLURAL, VERSION, names
from operator_bench_report import table

ROOT = Path(__file__).resolve().parents[1]
NS = "bench"
POLL_S = 0.5
PODS_PER_CR = 3
FULL = ("create", "update", "resume", "resync", "drift")
DESIGNS = {
    "after": {},
    "floor": {},  # no operator: see floor_client
}
METRICS_INTERVAL_S = 30.0  # every design (the default); the lag figure includes up to one interval
LAG_CR = "b-0000"
CREATE_CLIENTS = 8


def cr(name: str) -> dict:
    # No preset and no resources: pods schedule on any untainted kwok node (what is measured is the operator).
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DisaggregatedInference",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": "/models/tiny", "accelerator": "none", "image": "bench:1"},
    }


class Engines:
    """Stands in for every CR's engines and routers on loopback: prefill pods of CR `c` report
    `transfers[c]` transfers; /pool/<router pod> answers as a router does (router/poolstatus.py)."""

    def __init__(self) -> None:
        self.transfers: dict[str, int] = {}
        engines = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                pod = self.path.rsplit("/", 1)[-1]
                cr_name = pod.split("-prefill-")[0].split("-decode-")[0].split("-router-")[0]
                text = f'kvferry_transfers_total{{backend="UCX"}} {engines.transfers.get(cr_name, 0)}\n'
                if self.path.startswith("/pool/"):
                    body = json.dumps({"prefill": [text], "decode": [""], "unreachable": {}}).encode()
                else:
                    body = (text if "-prefill-" in pod else "").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def count_objects(api: client.ApiClient) -> int:
    """Managed objects in the namespace, counted with raw list calls (one per kind)."""
    total = 0
    for kind in RENDERED_KINDS:
        path = f"{Kube.path(kind, NS)}?labelSelector={names.LABEL_MANAGED_BY}%3D{names.MANAGED_BY}"
        data = api.call_api(*api.param_serialize("GET", path, auth_settings=["BearerToken"]))
        data.read()
        total += len(json.loads(data.data)["items"])
    return total


def list_crs(custom: client.CustomObjectsApi) -> list[dict]:
    return custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"]


def count_ready(custom: client.CustomObjectsApi) -> int:
    ready = 0
    for item in list_crs(custom):
        st = item.get("status", {})
        cond = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
        ready += (
            cond.get("status") == "True" and st.get("observedGeneration") == item["metadata"]["generation"]
        )
    return ready


def wait(pred, what: str, timeout_s: float) -> float | None:
    """Seconds until `pred()`; None if it did not happen within timeout_s."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            print(f"  {what}: not reached within {timeout_s:.0f} s", flush=True)
            return None
        time.sleep(POLL_S)
    return time.monotonic() - t0


def operator_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
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


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """VmHWM (peak) or VmRSS (now) of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def workloads_ready(api: client.ApiClient, per_cr: int) -> int:
    """CRs whose `per_cr` StatefulSets/Deployments all exist with readyReplicas == replicas (the floor's
    Ready: no operator writes status there)."""
    ready: dict[str, int] = {}
    for kind in ("StatefulSet", "Deployment"):
        path = f"{Kube.path(kind, NS)}?labelSelector={names.LABEL_MANAGED_BY}%3D{names.MANAGED_BY}"
        data = api.call_api(*api.param_serialize("GET", path, auth_settings=["BearerToken"]))
        data.read()
        for item in json.loads(data.data)["items"]:
            want, st = item["spec"].get("replicas", 1), item.get("status") or {}
            owner = (item["metadata"].get("ownerReferences") or [{}])[0].get("name", "")
            if st.get("readyReplicas", 0) == want and st.get("observedGeneration") == item["metadata"].get(
                "generation"
            ):
                ready[owner] = ready.get(owner, 0) + 1
    return sum(count >= per_cr for count in ready.values())


def floor_client(kubeconfig: str, n: int) -> int:
    """The floor's client (run as a subprocess): on "go" from stdin, CREATE_CLIENTS threads create the
    CRs; as each create returns, another CREATE_CLIENTS threads (the operator's reconcile threads)
    create what render makes of it, one request per object (Kube.apply of an unseen object, as the
    operator's first reconcile). Prints a JSON line: requests, peak memory, CPU seconds, errors."""
    kube = Kube.from_kubeconfig(kubeconfig)
    custom = client.CustomObjectsApi(kube.api)
    errors: list[str] = []

    def objects_of(created: dict) -> None:
        for obj in render(created).objects:
            try:
                kube.apply(obj, absent=True)
            except KubeError as exc:  # counted, not retried: the floor is what the server takes at once
                errors.append(str(exc))

    def create(body: dict) -> dict:
        created = custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
        done.append(time.monotonic())
        return created

    print("ready", flush=True)
    sys.stdin.readline()
    t0, done = time.monotonic(), []
    with ThreadPoolExecutor(CREATE_CLIENTS) as applier, ThreadPoolExecutor(CREATE_CLIENTS) as creator:
        futures = [creator.submit(create, cr(f"b-{i:04d}")) for i in range(n)]
        applies = [applier.submit(objects_of, f.result()) for f in futures]
        for f in applies:
            f.result()
    pid = os.getpid()
    out = {"requests": kube.total_requests(), "peak_rss_mib": rss_mib(pid), "cpu_s": cpu_s(pid)}
    out["created_s"] = max(done) - t0
    print(json.dumps({**out, "errors": len(errors), "first_error": errors[:1]}), flush=True)
    return 0


def source_at(rev: str, workdir: Path) -> Path:
    """The repo's tree at `rev` as an importable `kvferry` package (a directory to put on PYTHONPATH:
    it is found before the editable install, which the venv appends to the import path)."""
    root = workdir / f"src-{rev}"
    if not root.exists():
        (root / "kvferry").mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(root / "kvferry")], input=archive.stdout, check=True)
    return root


def start_operator(
    plane: ControlPlane, design: str, engines: Engines, port: int, log: Path, shard: str = "0/1"
) -> subprocess.Popen:
    base, _, rev = design.partition("@")  # "after@<rev>": the after design, the operator's code at <rev>
    paths = [str(source_at(rev, log.parent))] if rev else []
    paths += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    pythonpath = {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")},
        **pythonpath,
        "KVFERRY_METRICS_PORT": str(port),
        "KVFERRY_METRICS_HOST": "127.0.0.1",
        "KVFERRY_METRICS_INTERVAL": str(METRICS_INTERVAL_S),
        # The figures are about one wave of creations; the periodic resync (300 s) would add a full
        # reconcile of every CR in the middle of the slower design's run.
        "KVFERRY_RESYNC_INTERVAL": "3600",
        # kwok pods serve nothing and their IPs are not ours to reach: every design reads loopback.
        "KVFERRY_METRICS_URL": f"http://127.0.0.1:{engines.port}/engine/{{pod}}",
        "KVFERRY_POOL_METRICS_URL": f"http://127.0.0.1:{engines.port}/pool/{{pod}}",
        "KVFERRY_SHARD": shard,
        **DESIGNS[base],
    }
    argv = [shutil.which("kvferry") or "kvferry", "operator", "--standalone", "-n", NS]
    argv += ["--kubeconfig", str(plane.kubeconfig)]
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def create_all(custom: client.CustomObjectsApi, crs: list[dict]) -> None:
    """Create the CRs from CREATE_CLIENTS concurrent clients, as a GitOps sync would (kubectl apply of
    1,000 documents sends them one by one, which would measure kubectl, not the operator)."""
    with ThreadPoolExecutor(CREATE_CLIENTS) as pool:
        list(
            pool.map(
                lambda body: custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body), crs
            )
        )


def transfers_shown(custom: client.CustomObjectsApi, name: str) -> int:
    item = custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)
    return int(((item.get("status") or {}).get("transfer") or {}).get("transfers") or 0)


def summed(ports: list[int]) -> tuple[float, dict[str, float]]:
    """Requests and reconciles by trigger, summed over the replicas' metrics endpoints."""
    requests, reconciles = 0.0, {}
    for port in ports:
        req, rec = requests_and_reconciles(operator_metrics(port))
        requests += req
        reconciles = {k: reconciles.get(k, 0) + rec.get(k, 0) for k in {*reconciles, *rec}}
    return requests, reconciles


def run_design(
    design: str, n: int, cpu_nodes: int, timeout_s: float, workdir: Path, shards: int = 1, lag_s: float = 120
) -> dict[str, Any]:
    label = design if shards == 1 else f"{design}, {shards} shards"
    print(f"[{label}] starting a control plane with {cpu_nodes} kwok nodes", flush=True)
    plane = ControlPlane({"cpu": cpu_nodes})
    engines = Engines()
    procs: list[subprocess.Popen] = []  # the operator's replicas, or the floor's client
    out: dict[str, Any] = {"design": label, "crs": n}
    try:
        plane.start(workdir / label / "plane")
        rev = design.partition("@")[2]  # after@REV: the CRD of that tree (its operator rejects newer fields)
        root = source_at(rev, workdir) / "kvferry" if rev else ROOT
        plane.kubectl("apply", "--server-side", "-f", str(root / "crds/disaggregatedinferences.yaml"))
        plane.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=60s")
        plane.kubectl("create", "namespace", NS)
        planes = {k: plane.procs[k].pid for k in ("kube-apiserver", "kube-controller-manager")}
        ports = reserve_ports(shards)
        if design == "floor":
            argv = [sys.executable, __file__, "--floor-client", str(plane.kubeconfig), "--crs", str(n)]
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdout.readline()  # "ready": imports done
        else:
            for i, port in enumerate(ports):
                log = workdir / f"operator-{label}-{i}.log".replace(" ", "").replace(",", "-")
                procs.append(start_operator(plane, design, engines, port, log, f"{i}/{shards}"))
                if wait(lambda: _up(port), "operator metrics endpoint", 60) is None:  # noqa: B023
                    raise RuntimeError(f"operator did not start; log: {log}")
            time.sleep(5)  # settled after its start-up
            out["idle_rss_mib"] = sum(rss_mib(p.pid, "VmRSS") for p in procs)
        proc = procs[0]
        for i, p in enumerate(procs):
            planes[f"client{i}"] = p.pid
        cpu0 = {k: cpu_s(pid) for k, pid in planes.items() if pid}
        with plane.admin_client() as api:
            custom = client.CustomObjectsApi(api)
            t0 = time.monotonic()
            if design == "floor":
                proc.stdin.write("go\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
            else:
                req0, rec0 = summed(ports)
                create_all(custom, [cr(f"b-{i:04d}") for i in range(n)])
                out["apply_s"] = time.monotonic() - t0
            rendered = render(cr("x")).objects
            want = len(rendered) * n
            per_cr = sum(o["kind"] in ("StatefulSet", "Deployment") for o in rendered)
            left = lambda: max(timeout_s - (time.monotonic() - t0), 1)  # noqa: E731
            got = wait(lambda: count_objects(api) >= want, "all objects", left())
            out["objects_s"] = None if got is None else time.monotonic() - t0
            out["objects"], out["objects_want"] = count_objects(api), want
            ready = (
                (lambda: workloads_ready(api, per_cr)) if design == "floor" else lambda: count_ready(custom)
            )
            got = wait(lambda: ready() >= n, "all Ready", left())
            out["ready_s"] = None if got is None else time.monotonic() - t0
            out["ready_count"] = ready()
            out["workloads_ready"] = workloads_ready(api, per_cr)  # the floor's Ready, for every design
            # The floor's client has exited by now: its CPU comes from its own report.
            live = {k: pid for k, pid in planes.items() if not k.startswith("client") or design != "floor"}
            cpu = {k: cpu_s(pid) - cpu0[k] for k, pid in live.items()}
            clients = [v for k, v in cpu.items() if k.startswith("client")]
            out["cpu_s"] = {k: v for k, v in cpu.items() if not k.startswith("client")} | {
                "client": sum(clients)
            }
            if design == "floor":
                report = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
                out.update({k: report[k] for k in ("requests", "peak_rss_mib", "created_s")})
                out["peak_rss_each"] = [report["peak_rss_mib"]]
                out["cpu_s"]["client"] = report["cpu_s"] - cpu0["client0"]
                out["client_errors"] = report["errors"]
                if report["errors"]:
                    print(f"  floor client: {report['errors']} errors, first {report['first_error']}")
                return out
            time.sleep(5)  # let trailing status events settle before counting
            req1, rec1 = summed(ports)
            full = sum(rec1.get(k, 0) - rec0.get(k, 0) for k in FULL)
            out["requests"] = req1 - req0
            out["full_reconciles"] = full
            out["by_trigger"] = {k: rec1.get(k, 0) - rec0.get(k, 0) for k in rec1}
            # Status lag: one CR's transfers move; how long until its status shows them.
            engines.transfers[LAG_CR] = 4242
            t1 = time.monotonic()
            lag = wait(lambda: transfers_shown(custom, LAG_CR) == 4242, "status lag", lag_s)
            out["lag_s"] = None if lag is None else time.monotonic() - t1
            out["peak_rss_each"] = [rss_mib(p.pid) for p in procs]
            out["peak_rss_mib"] = sum(out["peak_rss_each"])
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        engines.close()
        plane.stop()
    return out


def _up(port: int) -> bool:
    try:
        operator_metrics(port)
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crs", type=int, default=1000, help="CRs applied at once")
    p.add_argument("--cpu-nodes", type=int, default=0, help="kwok cpu nodes (110 pods each); 0 = enough")
    p.add_argument(
        "--designs",
        default="floor,after",
        help="comma-separated: floor, after; after@REV: the operator's code at git REV",
    )
    p.add_argument(
        "--shards", type=int, default=1, help="also run each operator design as this many shard replicas"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per design from apply to all Ready")
    p.add_argument(
        "--lag-timeout", type=float, default=120, help="seconds to wait for the status lag figure after Ready"
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--floor-client", metavar="KUBECONFIG", help=argparse.SUPPRESS)  # the floor's subprocess
    args = p.parse_args(argv)
    if args.floor_client:
        return floor_client(args.floor_client, args.crs)
    designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    if unknown := [d for d in designs if d.partition("@")[0] not in DESIGNS or d.startswith("floor@")]:
        p.error(f"unknown design(s) {unknown}; known: {sorted(DESIGNS)}")
    nodes = args.cpu_nodes or -(-(args.crs * PODS_PER_CR + 10) // 110)
    if args.crs * PODS_PER_CR > nodes * 110:
        p.error(f"{args.crs} CRs need {args.crs * PODS_PER_CR} pods; {nodes} nodes hold {nodes * 110}")
    # SIGTERM unwinds like Ctrl-C, so the operator and the control plane are stopped (by PID) too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs = [(d, 1) for d in designs]
    runs += [(d, args.shards) for d in designs if args.shards > 1 and d != "floor"]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvferry-opbench-") as tmp:
        for design, shards in runs:
            try:
                results.append(
                    run_design(design, args.crs, nodes, args.timeout, Path(tmp), shards, args.lag_timeout)
                )
            except Exception:  # one design failing still leaves the others' figures
                traceback.print_exc()
                label = design if shards == 1 else f"{design}, {shards} shards"
                results.append({"design": f"{label} (failed)", "crs": args.crs})
            print(table(results), flush=True)
    print(
        f"\n{args.crs} CRs applied at once, {nodes} kwok nodes, metrics interval {METRICS_INTERVAL_S:.0f} s"
    )
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
