"""Stack step: bring up (and tear down) the whole local kvferry stack for `kvferry demo` and its test.

Order: control-plane binaries and the tiny model (both cached) -> control plane with the cpu node left
to our node agent -> CRD -> operator (its own process) -> node agent (in this process) -> the demo CR.
`stop()` undoes everything that was started, newest first, by PID or object; it is safe after a
partial start and safe to call twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kvferry.local.controlplane import ControlPlane, build
from kvferry.local.nodeagent.agent import NodeAgent
from kvferry.local.nodeagent.kube import Kube, KubeError

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "disaggregatedinferences.yaml"
GROUP, VERSION, PLURAL = "kvferry.io", "v1alpha1", "disaggregatedinferences"
AGENT_NODE = "cpu-0"
POD_CIDR = "10.213.0.0/24"  # inside the node's network namespace (see nodeagent/netns.py)
OPERATOR_STOP_S = 15.0
METRICS_INTERVAL_S = 5.0  # the operator's default is 30 s; the demo wants transfers to count up visibly

Report = Callable[[str], None]


class StackError(RuntimeError):
    """A step of the stack failed; the message names the step and where its log is."""


def demo_cr(name: str, namespace: str, model: Path, prefill: int = 1, decode: int = 1) -> dict[str, Any]:
    """The demo's DisaggregatedInference: cpu preset, the local tiny model (a path on this machine)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DisaggregatedInference",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": str(model),
            "servedModelName": "tiny",
            "accelerator": "cpu",
            # float32: the tiny model's own dtype (auto would downcast to bf16); the cpu preset's block
            # size (128) fits vLLM-CPU; eager: no torch.compile, a minute per server start on two cores.
            "vllm": {
                "dtype": "float32",
                "maxModelLen": 2048,
                "extraArgs": ["--enforce-eager"],
            },
            "prefill": {"replicas": prefill},
            "decode": {"replicas": decode},
        },
    }


class Stack:
    """The running pieces; each attribute is set once its step has started."""

    def __init__(self, workdir: Path, report: Report = print, pod_cidr: str = POD_CIDR) -> None:
        self.workdir = Path(workdir).resolve()
        self.pod_cidr = pod_cidr
        self.report = report
        self.plane: ControlPlane | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.agent: NodeAgent | None = None
        self.kube: Kube | None = None
        self.model: Path | None = None

    # --- bring-up --------------------------------------------------------------------------------
    def build(self, out: Any = None) -> None:
        """Cached builds: control-plane binaries (tens of minutes cold) and the tiny model (seconds)."""
        build.ensure_built(out=out or sys.stdout)
        from kvferry.local import tinymodel

        self.model = tinymodel.ensure("llama")

    def start_plane(self) -> None:
        self.plane = ControlPlane(kwok_cpu=False)
        self.plane.start(self.workdir / "controlplane")
        self.kube = Kube(str(self.plane.kubeconfig))

    def install_crd(self) -> None:
        plane = self._plane()
        if not CRD_FILE.is_file():
            raise StackError(f"CRD file {CRD_FILE} is missing (generate it with `kvferry generate`)")
        plane.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
        # Polled here: `kubectl wait` fails at once while the new CRD has no status.conditions yet.
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{PLURAL}.{GROUP}"
        wait_until("CRD Established", lambda: _established(self._kube().get(path)), 60.0)

    def start_operator(self) -> None:
        plane = self._plane()
        log = self.workdir / "logs" / "operator.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "kvferry.cli", "operator", "--standalone"]
        argv += ["--kubeconfig", str(plane.kubeconfig), "--metrics-interval", str(METRICS_INTERVAL_S)]
        with log.open("ab") as fh:
            self.operator = subprocess.Popen(
                argv, env=plane.env(), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        time.sleep(2.0)
        if self.operator.poll() is not None:
            raise StackError(f"operator exited at once (rc={self.operator.returncode}); log: {log}")

    def start_agent(self) -> None:
        plane = self._plane()
        self.agent = NodeAgent(str(plane.kubeconfig), AGENT_NODE, self.pod_cidr, str(self.workdir / "node"))
        self.agent.start()

    def apply(self, obj: dict[str, Any]) -> None:
        """Create or update an object with kubectl (server-side apply, field manager kvferry-demo)."""
        self._plane().kubectl(
            "apply", "--server-side", "--field-manager=kvferry-demo", "-f", "-", input=yaml.safe_dump(obj)
        )

    def ensure_namespace(self, namespace: str) -> None:
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})

    # --- reading ---------------------------------------------------------------------------------
    def get_cr(self, namespace: str, name: str) -> dict[str, Any]:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        return self._kube().get(path)

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else None
        return self._kube().get(f"/api/v1/namespaces/{namespace}/pods", params).get("items", [])

    def kubectl_get(self, namespace: str) -> str:
        res = self._plane().kubectl("get", PLURAL, "-n", namespace, check=False, timeout_s=20)
        return (res.stdout or res.stderr).rstrip()

    def router_url(self, namespace: str, name: str) -> str | None:
        """http://<router pod IP>:<port> of a Ready router pod (no kube-proxy: pod IPs are reachable)."""
        for pod in self.pods(namespace, f"kvferry.io/name={name},kvferry.io/role=router"):
            if pod_ready(pod):
                port = _port(pod, "http") or 8000
                return f"http://{pod['status']['podIP']}:{port}"
        return None

    # --- teardown --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Operator first (it would recreate what the agent stops), then the agent's pods, then the plane."""
        if self.operator is not None:
            _stop_group(self.operator, OPERATOR_STOP_S)
            self.operator = None
        if self.agent is not None:
            self.agent.stop()
            self.agent = None
        if self.kube is not None:
            self.kube.close()
            self.kube = None
        if self.plane is not None:
            self.plane.stop()
            self.plane = None

    def _plane(self) -> ControlPlane:
        if self.plane is None:
            raise StackError("the control plane is not running")
        return self.plane

    def _kube(self) -> Kube:
        if self.kube is None:
            raise StackError("the control plane is not running")
        return self.kube


def pod_ready(pod: dict[str, Any]) -> bool:
    conds = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}
    return conds.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp")


def _established(crd: dict[str, Any]) -> bool:
    conds = (crd.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conds)


def _port(pod: dict[str, Any], name: str) -> int | None:
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return int(port["containerPort"])
    return None


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_until(
    what: str, pred: Callable[[], Any], timeout_s: float, tick: Callable[[], None] | None = None
) -> Any:
    """Poll `pred` until truthy; StackError naming `what` after `timeout_s`. API errors count as 'not yet'."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = pred()
        except KubeError:
            value = None
        if value:
            return value
        if tick is not None:
            tick()
        time.sleep(1.0)
    raise StackError(f"timed out after {timeout_s:.0f} s waiting for {what}")
