"""Node step: the agent that makes one Node real: heartbeats, and a PodWorker per pod bound to it.

Ties the parts together: `kube` (API access), `watch` (which pods are ours), `pod` (one worker per
pod uid), `alloc` (pod IPs and cores) and `status` (node heartbeat). Stopping the agent stops every
process it started; the pod objects stay, as they would when a kubelet goes down.
"""

from __future__ import annotations

import base64
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvferry.local.nodeagent import alloc, cgroups, image, reaper, status
from kvferry.local.nodeagent.kube import Kube, KubeError
from kvferry.local.nodeagent.netns import NodeNetwork
from kvferry.local.nodeagent.pod import PodWorker
from kvferry.local.nodeagent.podspec import PodContext, PodSpecError
from kvferry.local.nodeagent.watch import PodWatcher

HEARTBEAT_S = 10.0
STOP_GRACE_CAP_S = 10.0  # agent shutdown: never wait a pod's full grace period (vLLM asks for 60 s+)

log = logging.getLogger("kvferry.nodeagent")


class NodeAgent:
    """Runs the pods bound to `node` as local processes; `start()` then `stop()`.

    `vllm`: what the pods' `vllm` command runs (default: vLLM's server from this virtualenv); see
    `image.write_bin_dir`.
    """

    def __init__(
        self,
        kubeconfig: str,
        node: str,
        pod_cidr: str = "10.213.0.0/24",
        workdir: str | None = None,
        cores: list[int] | None = None,
        max_exclusive_cores: int = 1,
        vllm: list[str] | None = None,
    ) -> None:
        self.kubeconfig, self.node = kubeconfig, node
        self.addresses = alloc.AddressPool(pod_cidr)
        # Named per process: a test's agent and the demo's may run side by side for the same node name.
        self.network = NodeNetwork(f"kvf-{node}-{os.getpid()}", pod_cidr)
        self.cores = alloc.CorePool(cores, max_exclusive_cores)
        self.limits: cgroups.CpuLimits | None = None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"kvferry-node-{node}-"))
        self.bin_dir = image.write_bin_dir(self.workdir / "bin", vllm)
        self.kube: Kube | None = None
        self.workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._watcher: PodWatcher | None = None

    @property
    def host_ip(self) -> str:
        return self.addresses.node_ip

    def start(self) -> None:
        self.kube = Kube(self.kubeconfig)
        try:
            self.kube.get(f"/api/v1/nodes/{self.node}")
        except KubeError as exc:
            raise KubeError(
                f"node {self.node!r} must exist before its agent starts: {exc}", exc.status
            ) from exc
        reaper.reap()  # a killed agent's namespace would capture this subnet's routes
        self.network.setup(self.host_ip)
        self.limits = cgroups.CpuLimits(f"{self.node}-{os.getpid()}")
        if not self.limits.available:
            log.warning("node %s: CPU limits will not be enforced: %s", self.node, self.limits.reason)
        port = urlparse(self.kube.server).port or 443
        self.network.forward_loopback_port(port)  # pods reach the API server at the same URL
        self._ready_since = status.now_iso()
        status.heartbeat_node(self.kube, self.node, self.host_ip, self._ready_since)
        self._heartbeat = threading.Thread(target=self._beat, name=f"heartbeat-{self.node}", daemon=True)
        self._heartbeat.start()
        self._watcher = PodWatcher(self.kube, self.node, self._on_pod, self._on_gone)
        self._watcher.start()
        log.info("node agent for %s up: node IP %s, workdir %s", self.node, self.host_ip, self.workdir)

    def stop(self) -> None:
        """Stop watching, then every pod's processes (in parallel, grace capped), then heartbeats."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        with self._lock:
            workers = list(self.workers.values())
        if workers:
            with ThreadPoolExecutor(max_workers=len(workers)) as pool:
                list(pool.map(lambda w: w.stop(STOP_GRACE_CAP_S), workers))
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=HEARTBEAT_S + 20)
        self.network.teardown()
        if self.limits is not None:
            self.limits.close()
        if self.kube is not None:
            self.kube.close()

    # --- events ----------------------------------------------------------------------------------
    def _on_pod(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if worker is not None:
                worker.update(pod)
                return
            if self._stop.is_set() or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return
            worker = self._new_worker(pod)
            self.workers[uid] = worker
        worker.update(pod)
        worker.start()

    def _on_gone(self, uid: str) -> None:
        with self._lock:
            worker = self.workers.get(uid)
        if worker is not None:
            worker.gone()

    def _new_worker(self, pod: dict[str, Any]) -> PodWorker:
        assert self.kube is not None
        server = urlparse(self.kube.server)
        pod_ip = self.addresses.take()
        self.network.add_pod_ip(pod_ip)
        ctx = PodContext(
            pod_ip=pod_ip,
            host_ip=self.host_ip,
            apiserver_host=server.hostname or "127.0.0.1",
            apiserver_port=server.port or 443,
            extra_env=image.pod_env(self.bin_dir, pod_ip),
            exec_prefix=tuple(self.network.exec_prefix()),
        )
        meta = pod["metadata"]
        root = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        return PodWorker(
            self.kube,
            pod,
            ctx,
            root,
            self._lookup,
            self._issue_token,
            self._worker_done,
            self.cores,
            self.limits,
        )

    def _worker_done(self, worker: PodWorker) -> None:
        with self._lock:
            self.workers.pop(worker.uid, None)
        self.network.remove_pod_ip(worker.ctx.pod_ip)
        self.addresses.give_back(worker.ctx.pod_ip)

    # --- what pods read from the API -------------------------------------------------------------
    def _lookup(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        assert self.kube is not None
        if kind == "persistentVolumeClaim":
            return self._claim_path(namespace, name)
        plural = "configmaps" if kind == "configMap" else "secrets"
        try:
            obj = self.kube.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        data = dict(obj.get("data") or {})
        if kind == "secret":
            return {k: base64.b64decode(v).decode() for k, v in data.items()}
        data.update(
            {
                k: base64.b64decode(v).decode(errors="replace")
                for k, v in (obj.get("binaryData") or {}).items()
            }
        )
        return data

    def _claim_path(self, namespace: str, name: str) -> dict[str, str] | None:
        """{"path": dir} of the hostPath/local PersistentVolume bound to claim `name`; None if absent."""
        assert self.kube is not None
        try:
            pvc = self.kube.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}")
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        volume = (pvc.get("spec") or {}).get("volumeName")
        if not volume or (pvc.get("status") or {}).get("phase") != "Bound":
            # Transient, as for the kubelet: the pod's setup is retried until the claim binds.
            raise KubeError(f"claim {namespace}/{name} is not bound to a PersistentVolume yet")
        pv = self.kube.get(f"/api/v1/persistentvolumes/{volume}")["spec"]
        path = (pv.get("hostPath") or pv.get("local") or {}).get("path")
        if not path:
            kinds = sorted(k for k in pv if k not in ("accessModes", "capacity", "claimRef"))
            raise PodSpecError(f"PersistentVolume {volume} ({kinds}) is not a local directory")
        return {"path": path}

    def _issue_token(self, ns: str, sa: str, pod: str, uid: str, audience: str | None, seconds: int) -> str:
        """A pod-bound service-account token (TokenRequest), as the kubelet projects one."""
        assert self.kube is not None
        spec: dict[str, Any] = {
            "expirationSeconds": max(600, seconds),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid},
        }
        if audience:
            spec["audiences"] = [audience]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        out = self.kube.request("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", body)
        return out["status"]["token"]

    def _beat(self) -> None:
        assert self.kube is not None
        while not self._stop.wait(HEARTBEAT_S):
            try:
                status.heartbeat_node(self.kube, self.node, self.host_ip, self._ready_since)
            except KubeError as exc:
                log.warning("node %s heartbeat: %s", self.node, exc)

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no pod worker is running (used by tests and shutdown checks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self.workers:
                    return True
            time.sleep(0.2)
        return False
