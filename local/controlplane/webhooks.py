"""Webhook controllers on a local plane: their release's webhook registrations pointed at 127.0.0.1.

A controller built from its Go module (LWS, Kueue) serves its admission webhooks from this machine; its
release registers them through a Service, which nothing routes on loopback. `by_url` rewrites each
registration to call `https://127.0.0.1:<port><path>` trusting the plane's CA, renamed so this module's
registrations are recognisable, and narrows the pod webhooks (`pods`: the selectors the release's own
kustomize patch adds) so the plane's other pods never call it. `ControllerProc` runs one such controller
(serving certificate, process, readiness, registrations) and undoes it on stop.
"""

from __future__ import annotations

import base64
import copy
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kvferry.local.controlplane import certs
from kvferry.local.controlplane.plane import ControlPlane
from kvferry.local.controlplane.processes import Proc, reserve_ports, wait_for
from kvferry.local.controlplane.rest import probe

START_TIMEOUT_S = 90.0


def by_url(
    manifests: str, prefix: str, webhook_port: int, ca_pem: bytes, pods: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The release's webhook configurations (a multi-document YAML), pointed at loopback by URL."""
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        doc = copy.deepcopy(doc)
        doc["metadata"] = {"name": prefix + doc["metadata"]["name"]}
        for hook in doc["webhooks"]:
            hook["clientConfig"] = url_client(hook["clientConfig"]["service"]["path"], webhook_port, ca_pem)
            if pods and any("pods" in rule["resources"] for rule in hook["rules"]):
                hook.update(copy.deepcopy(pods))
        out.append(doc)
    return out


def url_client(path: str, webhook_port: int, ca_pem: bytes) -> dict[str, str]:
    return {"url": f"https://127.0.0.1:{webhook_port}{path}", "caBundle": base64.b64encode(ca_pem).decode()}


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class ControllerProc:
    """One webhook controller on a running plane: `start` issues its serving certificate, starts it with
    the config `make_config(webhook_port, health_port, cert_dir)` wrote, waits for /readyz and the
    webhook port, then applies `registrations(webhook_port, ca_pem)`; `stop` removes them first, so
    the plane keeps admitting pods, then stops the process by its PID. Safe to call twice."""

    def __init__(self, plane: ControlPlane, name: str, binary: Path) -> None:
        self.plane, self.name, self.binary = plane, name, binary
        self.proc: Proc | None = None
        self._kinds: list[str] = []

    def start(
        self,
        workdir: Path,
        make_config: Callable[[int, int, Path], dict[str, Any]],
        registrations: Callable[[int, bytes], list[dict[str, Any]]],
        extra_args: tuple[str, ...] = (),
        wrap: Callable[[list[str], Path], list[str]] | None = None,
    ) -> None:
        """`wrap(argv, cert_dir)`: the command that runs argv (e.g. inside a mount namespace)."""
        workdir.mkdir(parents=True, exist_ok=True)
        pki = workdir / "certs"
        certs.issue_serving(certs.CertPair(self.plane.ca_file, self.plane.ca_file.with_suffix(".key")), pki)
        webhook_port, health_port = reserve_ports(2)
        cfg_path = workdir / f"{self.name}-config.yaml"
        cfg_path.write_text(yaml.safe_dump(make_config(webhook_port, health_port, pki)))
        argv = [
            str(self.binary),
            f"--config={cfg_path}",
            f"--kubeconfig={self.plane.kubeconfig}",
            *extra_args,
        ]
        if wrap is not None:
            argv = wrap(argv, pki)
        self.proc = Proc(self.name, argv, workdir / f"{self.name}.log").start()
        healthy = f"http://127.0.0.1:{health_port}/readyz"
        wait_for(f"{self.name} /readyz", lambda: probe(healthy) == "ok", START_TIMEOUT_S, [self.proc])
        wait_for(
            f"{self.name} webhook server listening",
            lambda: listening(webhook_port),
            START_TIMEOUT_S,
            [self.proc],
        )
        regs = registrations(webhook_port, self.plane.ca_file.read_bytes())
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": regs})
        self.plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=body)
        self._kinds = [f"{r['kind'].lower()}/{r['metadata']['name']}" for r in regs]

    def stop(self) -> None:
        if self._kinds:
            self.plane.kubectl("delete", "--ignore-not-found", *self._kinds, check=False)
            self._kinds = []
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
