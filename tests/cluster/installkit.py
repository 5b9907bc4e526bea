"""Helpers for tests/cluster/test_install_*.py: the chart on the test plane, the operator as its SA.

No kubelet runs real containers here, so the operator the chart installs is a kwok pod. The real one runs
as a local process with exactly the environment of the chart's Deployment (read back from the API server)
and a kubeconfig holding a TokenRequest token of the chart's ServiceAccount: RBAC is the chart's, nothing
more. Servers bind 127.0.0.1 only; engine metrics are "read" from a closed loopback port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from kvferry.local.controlplane import ControlPlane
from kvferry.operator.render import images

from tests.cluster.operator_fixtures import rbac_denials
from tests.waiting import WaitTimeout, wait_until

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvferry"
EXAMPLES = ROOT / "manifests" / "examples"
# The registry the tests install with (the chart requires one); the operator's own default, so image
# names match what the operator renders without KVFERRY_IMAGE_REGISTRY.
TEST_REGISTRY = images.DEFAULT_REGISTRY
HELM_TIMEOUT = "120s"
OPERATOR_START_TIMEOUT_S = 60.0
RECONCILE_TIMEOUT_S = 90.0


def unique(prefix: str) -> str:
    """A release or object name no other test uses (cluster-scoped chart objects carry the release name)."""
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def helm_install(
    plane: ControlPlane,
    release: str,
    namespace: str,
    *settings: str,
    upgrade: bool = False,
    wait: bool = False,
):
    """`helm install` (or `upgrade`) the chart, adopting CRDs another test or release already created.

    `wait`: until the operator Deployment is available (kwok runs its pod). Tests that run the operator
    locally only need the objects, so they skip the wait.
    """
    verb = ["upgrade", "--reuse-values"] if upgrade else ["install"]
    args = [*verb, release, str(CHART), "-n", namespace, "--take-ownership"]
    if not upgrade:  # the chart requires a registry (nothing is published); kwok pulls no image
        args += ["--set", f"image.registry={TEST_REGISTRY}"]
    if wait:
        args += ["--wait", "--timeout", HELM_TIMEOUT]
    for setting in settings:
        args += ["--set", setting]
    return plane.helm(*args, timeout_s=180)


def get_json(plane: ControlPlane, *args: str) -> dict[str, Any]:
    return json.loads(plane.kubectl("get", *args, "-o", "json").stdout)


def apply_yaml(plane: ControlPlane, namespace: str, doc: dict[str, Any], *flags: str) -> str:
    """`kubectl apply` one object from memory; returns kubectl's one-line report."""
    res = plane.kubectl("apply", "-n", namespace, *flags, "-f", "-", input=yaml.safe_dump(doc))
    return res.stdout.strip()


def example(filename: str, *, cr_name: str | None = None, **spec: Any) -> dict[str, Any]:
    """An example CR from manifests/examples/, optionally renamed and with top-level spec keys replaced."""
    doc = yaml.safe_load((EXAMPLES / filename).read_text())
    if cr_name:
        doc["metadata"]["name"] = cr_name
    doc["spec"].update(spec)
    return doc


def reconciled(plane: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    """The CR once the operator has observed its newest generation and created both StatefulSets."""
    cr = get_json(plane, "disaggregatedinference", name, "-n", namespace)
    if cr.get("status", {}).get("observedGeneration") != cr["metadata"]["generation"]:
        return None
    names = {s["metadata"]["name"] for s in get_json(plane, "statefulsets", "-n", namespace)["items"]}
    return cr if {f"{name}-prefill", f"{name}-decode"} <= names else None


def wait_reconciled(
    plane: ControlPlane, namespace: str, name: str, operator: OperatorProcess
) -> dict[str, Any]:
    """Wait for `reconciled`; on timeout the error carries the operator's log tail."""
    try:
        return wait_until(
            lambda: reconciled(plane, namespace, name), f"{name} reconciled", RECONCILE_TIMEOUT_S
        )
    except WaitTimeout as exc:
        raise WaitTimeout(f"{exc}\n--- operator log tail ---\n{operator.text()[-4000:]}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deployment_env(plane: ControlPlane, namespace: str, name: str) -> tuple[dict[str, str], list[str]]:
    """(env, args) of the operator container of the chart's Deployment, as the API server stores it."""
    deployment = get_json(plane, "deployment", name, "-n", namespace)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return env, list(container.get("args", []))


class OperatorProcess:
    """`kvferry operator` run locally with the chart Deployment's settings and ServiceAccount identity."""

    def __init__(self, kubeconfig: Path, env: dict[str, str], args: list[str], log: Path) -> None:
        self.health_port = free_port()
        closed_port = free_port()  # nothing listens: metric scrapes fail fast, and stay on loopback
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")},
            **env,
            "KUBECONFIG": str(kubeconfig),
            "KVFERRY_KUBECONFIG": str(kubeconfig),
            # The chart binds 0.0.0.0 inside the pod; here every server stays on 127.0.0.1.
            "KVFERRY_LIVENESS": f"127.0.0.1:{self.health_port}",
            "KVFERRY_METRICS_URL": f"http://127.0.0.1:{closed_port}/metrics",
            "KVFERRY_METRICS_INTERVAL": "3600",
        }
        self.metrics_port: int | None = None
        if self.env.get("KVFERRY_METRICS_PORT"):  # the chart's metrics.enabled
            self.metrics_port = free_port()
            self.env.update(KVFERRY_METRICS_PORT=str(self.metrics_port), KVFERRY_METRICS_HOST="127.0.0.1")
        self.args = args
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, wait_healthy: bool = True) -> OperatorProcess:
        argv = [sys.executable, "-m", "kvferry.cli", "operator", *self.args]
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                argv, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        if wait_healthy:
            wait_until(self._healthy, "operator /healthz", OPERATOR_START_TIMEOUT_S)
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited (rc={self.proc.returncode}):\n{self.text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as rsp:
                return rsp.status == 200
        except OSError:
            return False

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the operator's process group (it is its leader), SIGKILL after `grace_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def metrics(self) -> str:
        """The operator's own /metrics (what the chart's metrics Service scrapes)."""
        assert self.metrics_port, "metrics.enabled is false for this release"
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as rsp:
            return rsp.read().decode()

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def forbidden_lines(self) -> list[str]:
        """Log lines reporting an RBAC denial (HTTP 403 / Forbidden) from the API server."""
        return rbac_denials(self.text())


@contextmanager
def operator_as_chart_sa(
    plane: ControlPlane, namespace: str, release: str, log: Path, *, wait_healthy: bool = True
) -> Iterator[OperatorProcess]:
    """Run the operator of release `release` (installed in `namespace`) as its ServiceAccount."""
    env, args = deployment_env(plane, namespace, release)
    kubeconfig = plane.sa_kubeconfig(namespace, release, create=False)
    operator = OperatorProcess(kubeconfig, env, args, log)
    try:
        yield operator.start(wait_healthy=wait_healthy)
    finally:
        operator.stop()
