"""LeaderWorkerSet step: run the LWS controller (built from sigs.k8s.io/lws) against a local plane.

`Lws(plane).start(workdir)` applies LWS's CRD, issues its webhook server a 127.0.0.1 certificate from
the plane's CA, starts the controller with cert rotation and leader election off, and registers its
webhooks by URL (the release registers them through a Service, which nothing routes on loopback). The
pod webhooks get the objectSelector LWS's own kustomize patch adds, so pods that are not LWS's never
call it. `stop()` removes the webhook registrations before it stops the process, so the plane keeps
admitting pods and the CRD stays (its objects go with their namespaces).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvferry.local.controlplane import build, webhooks
from kvferry.local.controlplane.plane import ControlPlane
from kvferry.local.controlplane.processes import wait_until

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
    return webhooks.by_url(manifests, WEBHOOK_PREFIX, webhook_port, ca_pem, {"objectSelector": POD_SELECTOR})


class Lws:
    """The LWS controller and its webhooks on a running ControlPlane."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._ctl = webhooks.ControllerProc(plane, "lws-controller", build.binary("lws-controller"))

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
        manifests = (src / "webhooks.yaml").read_text()
        self._ctl.start(workdir, config, lambda port, ca: webhook_registrations(manifests, port, ca))
        return self

    def stop(self) -> None:
        """Unregister the webhooks, then stop the controller by its PID. Safe to call twice."""
        self._ctl.stop()

    def __enter__(self) -> Lws:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
