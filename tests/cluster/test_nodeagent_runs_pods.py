"""The local node agent runs pods bound to its Node as real processes against the real control plane.

Trivial pods (`python -m http.server` bound to the pod IP) show: Running/Ready from an httpGet readiness
probe, a loopback pod IP in status, configMap volumes served from their mapped path, deletion stopping
the process (and removing the pod), and restarts per restartPolicy for a crashing container.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from kubernetes import client
from kvferry.local.nodeagent.agent import NodeAgent

from tests.cluster import agent_nodes
from tests.waiting import wait_until

WAIT_S = 60.0


@pytest.fixture(scope="module")
def agent_node(control_plane, admin_api) -> Iterator[tuple[str, NodeAgent]]:
    with agent_nodes.agent_node(control_plane.kubeconfig, admin_api, "agent") as node:
        yield node


def _pod(node: str, name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "ignored:latest", "command": command}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 3, "containers": [container], **spec},
    }


def _read(core: client.CoreV1Api, ns: str, name: str) -> dict[str, Any]:
    return core.api_client.sanitize_for_serialization(core.read_namespaced_pod(name, ns))


def _ready(pod: dict[str, Any]) -> bool:
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
    return pod["status"].get("phase") == "Running" and conds.get("Ready") == "True"


def _pid(pod: dict[str, Any]) -> int:
    return int(pod["status"]["containerStatuses"][0]["containerID"].rsplit("/", 1)[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_http_server_pod_becomes_ready_on_its_own_ip_and_stops_on_delete(agent_node, admin_api, namespace):
    node, agent = agent_node
    core = client.CoreV1Api(admin_api)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "site"}, "data": {"hello.txt": "from cm"}}
    )
    command = [sys.executable, "-m", "http.server", "--bind", "$(POD_IP)", "--directory", "/srv/site", "8080"]
    spec = {
        "container": {
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/hello.txt", "port": "http"}, "periodSeconds": 1},
            "volumeMounts": [{"name": "site", "mountPath": "/srv/site"}],
        },
        "volumes": [{"name": "site", "configMap": {"name": "site"}}],
    }
    core.create_namespaced_pod(namespace, _pod(node, "web", command, **spec))
    pod = wait_until(
        lambda: (p := _read(core, namespace, "web")) and _ready(p) and p, "pod web Running and Ready", WAIT_S
    )

    ip = pod["status"]["podIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(f"{agent.host_ip}/24", strict=False)
    assert ip != agent.host_ip and pod["status"]["hostIP"] == agent.host_ip
    assert httpx.get(f"http://{ip}:8080/hello.txt", timeout=5).text == "from cm"
    pid = _pid(pod)
    assert _alive(pid)

    core.delete_namespaced_pod("web", namespace)
    wait_until(lambda: not _alive(pid), "the pod's process to exit", timeout_s=60)
    names = lambda: [p.metadata.name for p in core.list_namespaced_pod(namespace).items]  # noqa: E731
    wait_until(lambda: "web" not in names(), "pod web removed from the API", timeout_s=60)


@pytest.mark.parametrize(("policy", "restarts"), [("Always", True), ("Never", False)])
def test_crashing_container_restarts_per_restart_policy(agent_node, admin_api, namespace, policy, restarts):
    node, _ = agent_node
    core = client.CoreV1Api(admin_api)
    core.create_namespaced_pod(namespace, _pod(node, "crash", ["sh", "-c", "exit 3"], restartPolicy=policy))

    def status() -> dict[str, Any]:
        st = _read(core, namespace, "crash")["status"]
        return (st.get("containerStatuses") or [{}])[0] | {"phase": st.get("phase")}

    if restarts:
        st = wait_until(
            lambda: (s := status()).get("restartCount", 0) >= 2 and s, "two restarts", timeout_s=30
        )
        assert st["lastState"]["terminated"]["exitCode"] == 3
        assert st["phase"] == "Running"
    else:
        st = wait_until(lambda: (s := status())["phase"] == "Failed" and s, "phase Failed", timeout_s=30)
        assert st["restartCount"] == 0
        assert st["state"]["terminated"]["exitCode"] == 3
