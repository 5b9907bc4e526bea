"""LeaderWorkerSet step: run the LWS controller (built from sigs.k8s.io/lws) against a local plane.

`Lws(plane).start(workdir)` applies LWS's CRD, issues its webhook server a 127.0.0.1 certificate from
the plane's CA, starts the controller with cert rotation and leader election off, and registers its
webhooks by URL (the release registers them through a Service, which nothing routes on loopback). The
pod webhooks get the objectSelector LWS's own kustomize patch adds, so pods that are not LWS's never
call it. `stop()` removes the webhook registrations before it stops the process, so the plane keeps
admitting pods and the CRD stays (its objects go with their namespaces).
"""

from __future__ import annotations

import base64
import copy
import json
import socket
from pathlib import Path
from typing import Any

import yaml
from kvferry.local.controlplane import build, certs
from kvferry.local.controlplane.plane import ControlPlane
from kvferry.local.controlplane.processes import Proc, reserve_ports, wait_for, wait_until
from kvferry.local.controlplane.rest import probe

START_TIMEOUT_S = 90.0
CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
POD_SELECTOR = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
WEBHOOK_PREFIX = "kvferry-local-lws-"  # names of the registrations this module makes


def config(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """The controller's Configuration file (sigs.k8s.io/lws api/config/v1alpha1)."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},  # the cert comes from the plane's CA
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},  # off: nothing scrapes it here
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
    }


def webhook_registrations(manifests: str, webhook_port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """LWS's webhook configurations, pointed at https://127.0.0.1:<port><path> and trusting `ca_pem`."""
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        doc = copy.deepcopy(doc)
        doc["metadata"] = {"name": WEBHOOK_PREFIX + doc["metadata"]["name"]}
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{webhook_port}{path}",
                "caBundle": base64.b64encode(ca_pem).decode(),
            }
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = POD_SELECTOR
        out.append(doc)
    return out


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Lws:
    """The LWS controller and its webhooks on a running ControlPlane."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.proc: Proc | None = None
        self._kinds: list[str] = []

    def _established(self) -> bool:
        out = self.plane.kubectl("get", f"crd/{CRD_NAME}", "-o", "json").stdout
        conditions = json.loads(out).get("status", {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    def start(self, workdir: Path) -> Lws:
        build.ensure_built()
        src = build.lws_manifests_dir()
        self.plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(src / "crd.yaml"))
        # `kubectl wait` fails at once on a CRD whose status has no conditions yet: poll instead.
        wait_until(f"the {CRD_NAME} CRD established", self._established, 60.0)
        workdir.mkdir(parents=True, exist_ok=True)
        pki = workdir / "certs"
        certs.issue_serving(certs.CertPair(self.plane.ca_file, self.plane.ca_file.with_suffix(".key")), pki)
        webhook_port, health_port = reserve_ports(2)
        cfg_path = workdir / "lws-config.yaml"
        cfg_path.write_text(yaml.safe_dump(config(webhook_port, health_port, pki)))
        argv = [
            str(build.binary("lws-controller")),
            f"--config={cfg_path}",
            f"--kubeconfig={self.plane.kubeconfig}",
        ]
        self.proc = Proc("lws-controller", argv, workdir / "lws-controller.log").start()
        healthy = f"http://127.0.0.1:{health_port}/readyz"
        wait_for("lws-controller /readyz", lambda: probe(healthy) == "ok", START_TIMEOUT_S, [self.proc])
        wait_for(
            "lws webhook server listening", lambda: _listening(webhook_port), START_TIMEOUT_S, [self.proc]
        )
        regs = webhook_registrations(
            (src / "webhooks.yaml").read_text(), webhook_port, self.plane.ca_file.read_bytes()
        )
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": regs})
        self.plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=body)
        self._kinds = [f"{r['kind'].lower()}/{r['metadata']['name']}" for r in regs]
        return self

    def stop(self) -> None:
        """Unregister the webhooks, then stop the controller by its PID. Safe to call twice."""
        if self._kinds:
            self.plane.kubectl("delete", "--ignore-not-found", *self._kinds, check=False)
            self._kinds = []
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def __enter__(self) -> Lws:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
