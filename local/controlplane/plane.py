"""Control-plane step: start etcd, kube-apiserver, controller-manager, scheduler and kwok on loopback.

`ControlPlane(...).start(workdir)` builds whatever is missing (cached), writes certs and kubeconfigs into
`workdir`, starts the components on free 127.0.0.1 ports, creates the fake nodes, waits until the plane
really works (RBAC bootstrapped, default ServiceAccount created, nodes Ready) and records PIDs in
`workdir/plane.json` so `kvferry cluster down` can stop a plane started by another process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from kvferry.local.controlplane import build, certs, components, kubeconfig, nodes
from kvferry.local.controlplane.processes import ControlPlaneError, Proc, reserve_ports, wait_for
from kvferry.local.controlplane.rest import MERGE_PATCH, ApiError, Rest, probe

__all__ = ["ControlPlane", "ControlPlaneError"]

STATE_FILE = "plane.json"
ADMIN_KUBECONFIG = "admin.kubeconfig"
START_TIMEOUT_S = 120.0  # per wait; a warm start takes ~10-20 s on a busy 2-core machine
NODE_READY_TIMEOUT_S = 60.0
START_ATTEMPTS = 2  # a second try only after a port taken between choosing and binding it


class ControlPlane:
    """A real Kubernetes control plane on loopback. Use as a context manager or call start()/stop()."""

    def __init__(
        self, node_counts: dict[str, int] | None = None, *, kwok_cpu: bool = True, detached: bool = False
    ) -> None:
        self.node_counts = dict(nodes.DEFAULT_COUNTS if node_counts is None else node_counts)
        self.kwok_cpu = kwok_cpu  # False: the cpu nodes are left for another agent (kvferry demo)
        # Not detached: components get SIGKILL when the thread that started them dies (a killed test
        # run leaves nothing behind). Detached (`kvferry cluster up`): they outlive this process.
        self.detached = detached
        self.workdir: Path | None = None
        self.ports: components.Ports | None = None
        self.procs: dict[str, Proc] = {}
        self._certs: certs.PlaneCerts | None = None
        self._rest: Rest | None = None
        self.timings: dict[str, float] = {}  # seconds from start() to each milestone

    # --- paths and identities -------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self._dir() / ADMIN_KUBECONFIG

    @property
    def server(self) -> str:
        if self.ports is None:
            raise ControlPlaneError("control plane not started")
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def ca_file(self) -> Path:
        return self._dir() / "pki" / "ca.crt"

    def env(self) -> dict[str, str]:
        """Environment for kubectl/helm subprocesses aimed at this plane (never at ~/.kube/config)."""
        d = self._dir()
        path = f"{build.bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": path,
            "HELM_CACHE_HOME": str(d / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(d / "helm" / "config"),
            "HELM_DATA_HOME": str(d / "helm" / "data"),
        }

    def _dir(self) -> Path:
        if self.workdir is None:
            raise ControlPlaneError("control plane not started")
        return self.workdir

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self, workdir: Path, timeout_s: float = START_TIMEOUT_S) -> ControlPlane:
        build.ensure_built()
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start(timeout_s)
                return self
            except ControlPlaneError as e:
                self.stop()
                # Ports are free when chosen but another session may bind one first: retry with new ones.
                if "address already in use" not in str(e) or attempt == START_ATTEMPTS:
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> None:
        d, t0 = self._dir(), time.monotonic()

        def mark(step: str) -> None:
            self.timings[step] = round(time.monotonic() - t0, 1)

        shutil.rmtree(
            d / "etcd", ignore_errors=True
        )  # every start is a fresh cluster, even in an old workdir
        self._certs = certs.generate(d / "pki")
        self.ports = ports = components.Ports.from_list(reserve_ports(5))
        kc = self._write_kubeconfigs()
        logs = d / "logs"

        self._rest = Rest(self.server, self._certs.ca.cert, self._certs.clients["admin"])
        etcd = self._spawn("etcd", components.etcd(ports, d / "etcd"), logs)
        etcd_health = f"http://127.0.0.1:{ports.etcd_client}/health"
        wait_for("etcd /health", lambda: '"health":"true"' in probe(etcd_health), timeout_s, [etcd])
        mark("etcd")
        api = self._spawn("kube-apiserver", components.apiserver(ports, self._certs, d / "apiserver"), logs)
        wait_for("kube-apiserver /readyz", lambda: self._api().get("/readyz") == "ok", timeout_s, [etcd, api])
        mark("apiserver")
        argv = components.controller_manager(ports, self._certs, kc["controller-manager"], d / "kcm")
        self._spawn("kube-controller-manager", argv, logs)
        self._spawn("kube-scheduler", components.scheduler(ports, kc["scheduler"], d / "scheduler"), logs)
        self._spawn("kwok", components.kwok(kc["kwok"]), logs)
        self._save_state()

        self.apply_nodes(self.node_counts, wait=False)
        watch = list(self.procs.values())
        wait_for(
            "ServiceAccount default/default (controller-manager)", self._default_sa_exists, timeout_s, watch
        )
        mark("controller-manager")
        sched = f"https://127.0.0.1:{ports.scheduler}/healthz"
        wait_for("kube-scheduler /healthz", lambda: probe(sched, insecure=True) == "ok", timeout_s, watch)
        mark("scheduler")
        specs = nodes.manifests(self.node_counts, kwok_cpu=self.kwok_cpu)
        self.wait_nodes_ready([b["metadata"]["name"] for b in specs if _is_kwok(b)], timeout_s)
        mark("nodes")

    def stop(self) -> None:
        """Stop every component, newest first, by PID. Safe to call twice or after a failed start."""
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        self.procs.clear()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str], logs: Path) -> Proc:
        proc = Proc(name, argv, logs / f"{name}.log").start(tie_to_parent=not self.detached)
        self.procs[name] = proc
        return proc

    def _write_kubeconfigs(self) -> dict[str, Path]:
        assert self._certs is not None
        d, out = self._dir(), {}
        for ident in certs.CLIENTS:
            pair = self._certs.clients[ident.name]
            cfg = kubeconfig.render(self.server, self._certs.ca.cert, ident.user, client=pair)
            name = ADMIN_KUBECONFIG if ident.name == "admin" else f"{ident.name}.kubeconfig"
            out[ident.name] = kubeconfig.write(d / name, cfg)
        return out

    # --- state file (for `kvferry cluster down/env` from another process) ------------------------

    def _save_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ports": vars(self.ports),
            "kwok_cpu": self.kwok_cpu,
            "procs": {n: {"pid": p.pid, "argv": p.argv, "log": str(p.log)} for n, p in self.procs.items()},
        }
        (self._dir() / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    def attach(cls, workdir: Path) -> ControlPlane:
        """A handle on a plane started by another process from its state file (for down/env)."""
        path = Path(workdir).resolve() / STATE_FILE
        if not path.is_file():
            raise ControlPlaneError(f"no control plane state at {path} (was `kvferry cluster up` run there?)")
        state = json.loads(path.read_text())
        plane = cls(kwok_cpu=state["kwok_cpu"])
        plane.workdir, plane.ports = path.parent, components.Ports(**state["ports"])
        for name, p in state["procs"].items():
            plane.procs[name] = Proc(name, p["argv"], Path(p["log"]), pid=p["pid"])
        pki = plane.workdir / "pki"
        admin = certs.CertPair(pki / "client-admin.crt", pki / "client-admin.key")
        plane._rest = Rest(plane.server, pki / "ca.crt", admin)
        return plane

    # --- clients ---------------------------------------------------------------------------------

    def admin_client(self):
        """A kubernetes.client.ApiClient as cluster-admin (client cert in group system:masters)."""
        return kubeconfig.api_client(self.kubeconfig)

    def sa_client(self, namespace: str, name: str, *, create: bool = True):
        """An ApiClient that acts as ServiceAccount `namespace/name` with a real TokenRequest token."""
        with self.admin_client() as admin:
            token = kubeconfig.service_account_token(admin, namespace, name, create=create)
        return kubeconfig.token_client(self.server, self.ca_file, token)

    def sa_kubeconfig(self, namespace: str, name: str, *, create: bool = True) -> Path:
        """A kubeconfig file acting as ServiceAccount `namespace/name` (for kubectl/helm/kopf runs)."""
        with self.admin_client() as admin:
            token = kubeconfig.service_account_token(admin, namespace, name, create=create)
        cfg = kubeconfig.render(self.server, self.ca_file, f"sa-{namespace}-{name}", token=token)
        return kubeconfig.write(self._dir() / f"sa-{namespace}-{name}.kubeconfig", cfg)

    def kubectl(self, *args: str, timeout_s: float = 60, check: bool = True, input: str | None = None):
        return self._tool("kubectl", args, timeout_s, check, input)

    def helm(self, *args: str, timeout_s: float = 120, check: bool = True):
        return self._tool("helm", args, timeout_s, check, None)

    def _tool(self, tool: str, args: tuple[str, ...], timeout_s: float, check: bool, input: str | None):
        argv = [str(build.binary(tool)), f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout_s, input=input
        )
        if check and res.returncode != 0:
            raise ControlPlaneError(f"`{tool} {' '.join(args)}` failed (rc={res.returncode}):\n{res.stderr}")
        return res

    # --- nodes -----------------------------------------------------------------------------------

    def apply_nodes(
        self, counts: dict[str, int] | None = None, *, kwok_cpu: bool | None = None, wait: bool = True
    ) -> list[str]:
        """Create (or update) fake nodes; returns their names. Waits for kwok-run nodes to be Ready."""
        kwok_cpu = self.kwok_cpu if kwok_cpu is None else kwok_cpu
        specs = nodes.manifests(counts, kwok_cpu=kwok_cpu)
        rest = self._api()
        for body in specs:
            path = f"/api/v1/nodes/{body['metadata']['name']}"
            try:
                rest.call("POST", "/api/v1/nodes", body)
            except ApiError as e:
                if e.status != 409:
                    raise
                rest.call("PATCH", path, {"metadata": body["metadata"], "spec": body["spec"]}, MERGE_PATCH)
                rest.call("PATCH", f"{path}/status", {"status": body["status"]}, MERGE_PATCH)
        names = [b["metadata"]["name"] for b in specs]
        if wait:
            self.wait_nodes_ready([b["metadata"]["name"] for b in specs if _is_kwok(b)], NODE_READY_TIMEOUT_S)
        return names

    def wait_nodes_ready(self, names: list[str], timeout_s: float = NODE_READY_TIMEOUT_S) -> None:
        """Wait until each node is Ready and the not-ready taint is lifted (so pods can schedule)."""

        def ready() -> bool:
            items = {n["metadata"]["name"]: n for n in self._api().get("/api/v1/nodes")["items"]}
            return all(n in items and _node_schedulable(items[n]) for n in names)

        wait_for(
            f"nodes Ready and untainted: {', '.join(names)}", ready, timeout_s, list(self.procs.values())
        )

    def _default_sa_exists(self) -> bool:
        return self._api().exists("/api/v1/namespaces/default/serviceaccounts/default")

    def _api(self) -> Rest:
        if self._rest is None:
            raise ControlPlaneError("control plane not started by this process")
        return self._rest


def _is_kwok(body: dict[str, Any]) -> bool:
    return body["metadata"]["annotations"].get(nodes.KWOK_ANNOTATION) == nodes.KWOK_VALUE


def _node_schedulable(node: dict[str, Any]) -> bool:
    conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions") or []}
    taints = {t["key"] for t in node.get("spec", {}).get("taints") or []}
    return conds.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints
