"""Fixtures for the operator's cluster tests: the CRD installed, the operator's ServiceAccount bound to
exactly the RBAC in codegen/rbac.py, and `kvferry operator` run as a real subprocess per test.

The fixtures are registered for every test by `pytest_plugins` in tests/conftest.py: a test requests
them by name and imports only the plain helpers it uses from here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from kvferry.codegen import rbac
from kvferry.local.controlplane.processes import reserve_ports
from kvferry.operator.reconcile.apply import RENDERED_KINDS, RESOURCES, Kube
from kvferry.operator.spec import GROUP, PLURAL, VERSION, names

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "kvferry-system"
OPERATOR_SA = "kvferry-operator"
OPERATOR_START_TIMEOUT_S = 120.0  # generous: the 2-core test box is shared
WAIT_S = 120.0  # generous: kwok and the API server share 2 cores with the test run


def exists(read: Callable, *args: str) -> bool:
    """Whether `read(*args)` finds the object (404: no; any other API error is raised)."""
    try:
        read(*args)
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


@pytest.fixture(scope="session")
def kvferry_crd(control_plane, kubeconfig) -> str:
    """The generated CRD (and kopf's peering CRDs) applied and Established."""
    for path in ("crds/disaggregatedinferences.yaml", "crds/kopf-peerings.yaml"):
        control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / path))
    crd = f"{PLURAL}.{GROUP}"
    control_plane.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    return crd


@pytest.fixture(scope="session")
def operator_kubeconfig(control_plane, admin_api, kvferry_crd) -> Path:
    """A kubeconfig acting as the operator's ServiceAccount, bound to rbac.cluster_role() only."""
    core, authz = client.CoreV1Api(admin_api), client.RbacAuthorizationV1Api(admin_api)
    try:
        core.create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}})
    except ApiException as exc:
        if exc.status != 409:
            raise
    for create, body in (
        (authz.create_cluster_role, rbac.cluster_role()),
        (authz.create_cluster_role_binding, rbac.cluster_role_binding(OPERATOR_NAMESPACE, OPERATOR_SA)),
    ):
        try:
            create(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
    return control_plane.sa_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SA, create=True)


class OperatorProcess:
    """`kvferry operator` as a subprocess; stopped by PID."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        log: Path,
        *args: str,
        env: dict[str, str | None] | None = None,
        exe: str | None = None,
    ):
        # exe: another installation's console script (tests/wheel: the built wheel's, in a clean venv).
        exe = exe or shutil.which("kvferry")
        assert exe, "kvferry console script not on PATH (source scripts/env.sh)"
        self.log = log
        self.liveness = f"127.0.0.1:{reserve_ports(1)[0]}"
        mode = [] if "--peering" in args else ["--standalone"]  # peering = leader election
        argv = [
            exe,
            "operator",
            *mode,
            "-n",
            namespace,
            "--kubeconfig",
            str(kubeconfig),
            "--liveness",
            self.liveness,
            *args,
        ]
        self._out = log.open("ab")
        # kwok pods serve nothing: engine metrics come from test servers through --metrics-url, read
        # pod by pod. The router path (one request per CR) has its own test with a real router.
        env = {**os.environ, "KVFERRY_TRANSFER_SOURCE": "pods", **(env or {})}
        env = {k: v for k, v in env.items() if v is not None}  # None in `env`: unset it
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_started(self) -> None:
        """Wait for kopf's liveness endpoint (it answers once the operator has started)."""

        def alive() -> bool:
            if self.proc.poll() is not None:
                return True
            try:
                return urllib.request.urlopen(f"http://{self.liveness}/healthz", timeout=2).status == 200
            except OSError:
                return False

        try:
            wait_until(alive, "operator liveness", OPERATOR_START_TIMEOUT_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.text()[-3000:]}") from None
        assert self.proc.poll() is None, f"operator exited:\n{self.text()[-3000:]}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        return self.proc.returncode

    def forbidden(self) -> list[str]:
        return rbac_denials(self.text())


# An HTTP 403 or an API server "forbidden"/"is not allowed" message. The status code must stand alone:
# a log timestamp's milliseconds ("15:03:18,403") are not a denial.
_DENIAL = re.compile(r"(?<![\d,.:])\b403\b(?![\d,.:])|forbidden|is not allowed", re.IGNORECASE)


# A 403 for creating in a namespace being deleted (another test's, torn down) is no RBAC gap.
_TERMINATING = re.compile(r"because it is being terminated|NamespaceTerminating")


def rbac_denials(text: str) -> list[str]:
    """Log lines that report an RBAC denial from the API server."""
    return [line for line in text.splitlines() if _DENIAL.search(line) and not _TERMINATING.search(line)]


@pytest.fixture
def start_operator(operator_kubeconfig, namespace, tmp_path) -> Iterator[Callable[..., OperatorProcess]]:
    """Factory: start `kvferry operator` for the test's namespace as the operator SA. Every process is
    stopped at teardown and its log must show no 403 (the shipped RBAC is enough)."""
    started: list[OperatorProcess] = []

    def start(
        *args: str, env: dict[str, str | None] | None = None, wait: bool = True, exe: str | None = None
    ) -> OperatorProcess:
        log = tmp_path / f"operator-{len(started)}.log"
        op = OperatorProcess(operator_kubeconfig, namespace, log, *args, env=env, exe=exe)
        started.append(op)
        if wait:
            op.wait_started()
        return op

    yield start
    for op in started:
        op.stop()
    denied = [line for op in started for line in op.forbidden()]
    assert not denied, "operator hit 403s:\n" + "\n".join(denied[:20])


@pytest.fixture
def operator_kube(operator_kubeconfig) -> Iterator[Kube]:
    """The operator's own API client acting as its ServiceAccount, for tests that run its steps
    (reconcile, scrape) in the test process: same code and RBAC, with hooks a subprocess cannot take."""
    kube = Kube.from_kubeconfig(str(operator_kubeconfig))
    yield kube
    kube.close()


@pytest.fixture
def operator(start_operator) -> OperatorProcess:
    # Engine metrics go nowhere by default (kwok pod IPs are not real); tests that want them annotate the CR.
    return start_operator("--metrics-interval", "1", "--metrics-url", "http://127.0.0.1:9/{pod}")


class Cluster:
    """Small helpers over the admin API for assertions."""

    def __init__(self, plane, api, namespace: str):
        self.plane, self.api, self.ns = plane, api, namespace
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)

    def apply(self, cr: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess:
        cr = {**cr, "metadata": {**cr["metadata"], "namespace": self.ns}}
        return self.plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(cr), check=check)

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.plane.kubectl("-n", self.ns, *args, check=check)

    def cr(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def condition(self, name: str, ctype: str) -> dict[str, Any]:
        conds = self.cr(name).get("status", {}).get("conditions", [])
        return next((c for c in conds if c["type"] == ctype), {})

    def ready(self, name: str) -> bool:
        cr = self.cr(name)
        cond = next((c for c in cr.get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})
        return (
            cond.get("status") == "True"
            and cr["status"].get("observedGeneration") == cr["metadata"]["generation"]
        )

    def wait_ready(self, name: str, what: str = "", timeout_s: float = WAIT_S) -> None:
        """Wait for Ready=True on the current generation; on timeout say why (conditions, pods)."""
        try:
            wait_until(lambda: self.ready(name), what or f"{name} Ready", timeout_s)
        except AssertionError as exc:
            conds = [
                (c["type"], c["status"], c["reason"], c["message"][:160])
                for c in self.cr(name).get("status", {}).get("conditions", [])
            ]
            pods = [
                (p["metadata"]["name"], p["status"].get("phase"), p["spec"].get("nodeName"))
                for p in self.pods(name)
            ]
            raise AssertionError(f"{exc}\nconditions: {conds}\npods: {pods}") from None

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        res = self.kubectl("get", kind, name, "-o", "json", check=False)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def owned(self, cr_name: str) -> dict[tuple[str, str], dict[str, Any]]:
        """Every object labelled as made for `cr_name`, by (kind, name)."""
        kinds = ",".join(RESOURCES[k][1] for k in RENDERED_KINDS)
        res = self.kubectl("get", kinds, "-l", f"{names.LABEL_NAME}={cr_name}", "-o", "json")
        return {(o["kind"], o["metadata"]["name"]): o for o in json.loads(res.stdout)["items"]}

    def pods(self, cr_name: str, role: str | None = None) -> list[dict[str, Any]]:
        sel = f"{names.LABEL_NAME}={cr_name}" + (f",{names.LABEL_ROLE}={role}" if role else "")
        return json.loads(self.kubectl("get", "pods", "-l", sel, "-o", "json").stdout)["items"]

    def events(self, reason: str) -> list[dict[str, Any]]:
        res = self.kubectl("get", "events", "--field-selector", f"reason={reason}", "-o", "json")
        return json.loads(res.stdout)["items"]


@pytest.fixture
def cluster(control_plane, admin_api, namespace) -> Iterator[Cluster]:
    yield Cluster(control_plane, admin_api, namespace)
    # Engine pods have long grace periods (model drain) which kwok honours: remove the workloads, then
    # their pods without grace, so the namespace goes at once and the suite stays short.
    for args in (
        ("delete", "disaggregatedinferences,statefulsets,deployments", "--all", "--wait=false"),
        ("delete", "pods", "--all", "--grace-period=0", "--force", "--wait=false"),
    ):
        control_plane.kubectl("-n", namespace, *args, check=False)


EXPECTED_KINDS = {
    "ConfigMap": 1,
    "ServiceAccount": 1,
    "Role": 1,
    "RoleBinding": 1,
    "Service": 3,
    "StatefulSet": 2,
    "PodDisruptionBudget": 2,
    "Deployment": 1,
    "NetworkPolicy": 2,
}


def kinds_of(objs: dict[tuple[str, str], Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, _ in objs:
        out[kind] = out.get(kind, 0) + 1
    return out
