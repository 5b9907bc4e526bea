"""Gang admission with the real Kueue v0.17.0 controller (built from sigs.k8s.io/kueue, webhooks by URL) and
the real operator: a P/D service whose ClusterQueue quota fits only one role starts no pod at all, and
says why in GangAdmitted; once the quota fits the whole service, Kueue releases prefill and decode
together and GangAdmitted says so.

Marked `kueue`: it runs in every full run, last; a cold run builds Kueue (~15 min on 2 cores) in the
background while the other tests run, and this test waits for that build (tests/cluster/on_demand.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvferry.local.controlplane import ControlPlane
from kvferry.local.controlplane.kueue import Kueue
from kvferry.operator.spec import names

from tests.cluster import on_demand
from tests.cluster.operator_fixtures import WAIT_S
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

# The timeout covers the wait for a cold background build (on_demand.BUILD_WAIT_S) plus the test.
pytestmark = [pytest.mark.kueue, pytest.mark.timeout(on_demand.BUILD_WAIT_S + 600)]

GATE = "kueue.x-k8s.io/admission"
GPU = "nvidia.com/gpu"
HOLD_S = 8.0  # how long a held group is watched for any pod leaving the gate


@pytest.fixture(scope="module")
def kueue(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kueue]:
    on_demand.wait_built()
    with Kueue(control_plane).start(tmp_path_factory.mktemp("kueue")) as running:
        yield running


@pytest.fixture
def released(kueue: Kueue, cluster: Any, namespace: str) -> Iterator[None]:
    """After the test: delete the service and release its pods from Kueue's finalizer (kwok never
    reports a deleted pod terminal, which is when Kueue lets it go)."""
    yield
    cluster.kubectl("delete", "disaggregatedinferences,statefulsets,deployments", "--all", "--wait=false")
    cluster.kubectl("delete", "pods", "--all", "--wait=false")
    kueue.drop_finalizers("pods", namespace)


def _queues(namespace: str, gpus: int) -> list[dict[str, Any]]:
    """One flavor, a ClusterQueue with `gpus` GPUs (and room for everything else), a LocalQueue `gpu`."""
    quota = {"cpu": "1000", "memory": "100Ti", GPU: str(gpus), "vpc.amazonaws.com/efa": "1000"}
    api = "kueue.x-k8s.io/v1beta2"
    return [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": f"{namespace}-flavor"}},
        {
            "apiVersion": api,
            "kind": "ClusterQueue",
            "metadata": {"name": namespace},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": list(quota),
                        "flavors": [
                            {
                                "name": f"{namespace}-flavor",
                                "resources": [{"name": k, "nominalQuota": v} for k, v in quota.items()],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": api,
            "kind": "LocalQueue",
            "metadata": {"name": "gpu", "namespace": namespace},
            "spec": {"clusterQueue": namespace},
        },
    ]


def _apply(control_plane: ControlPlane, objs: list[dict[str, Any]]) -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": objs})
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=body)


def _gated(pod: dict[str, Any]) -> bool:
    return any(g["name"] == GATE for g in pod["spec"].get("schedulingGates") or [])


def _engines(cluster: Any) -> list[dict[str, Any]]:
    return [p for p in cluster.pods("gang") if p["metadata"]["labels"].get(names.LABEL_ROLE) in names.ROLES]


def _started(pods: list[dict[str, Any]]) -> list[str]:
    """Pods that left Kueue's gate or were bound to a node."""
    return [p["metadata"]["name"] for p in pods if not _gated(p) or p["spec"].get("nodeName")]


def test_quota_for_one_role_starts_nothing_and_quota_for_both_admits_them_together(
    control_plane, kueue, operator, cluster, namespace, released
):
    _apply(control_plane, _queues(namespace, gpus=1))  # each role's pod asks for 1 GPU: P or D, not both
    cr = make_inference("gang", accelerator="p5en", placement={"gang": "kueue", "queueName": "gpu"}).obj()
    cluster.apply(cr)

    pods = wait_until(
        lambda: _engines(cluster), "both engine pods created", WAIT_S, until=lambda p: len(p) == 2
    )
    held = wait_until(
        lambda: cluster.condition("gang", "GangAdmitted"),
        "GangAdmitted says Kueue holds the group for quota",
        WAIT_S,
        until=lambda c: c.get("reason") == "KueuePending" and "insufficient quota" in c.get("message", ""),
    )
    assert held["status"] == "False" and "gang-engines" in held["message"], held
    workload = cluster.get("workloads.kueue.x-k8s.io", "gang-engines")
    assert workload is not None, "Kueue made one Workload for the pod group"
    assert sum(ps["count"] for ps in workload["spec"]["podSets"]) == 2, workload["spec"]["podSets"]
    # All or nothing: with room for one role, neither leaves the gate (watched for a while, not once).
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        pods = _engines(cluster)
        assert len(pods) == 2 and not _started(pods), [(p["metadata"]["name"], p["spec"]) for p in pods]
        time.sleep(0.5)

    _apply(control_plane, _queues(namespace, gpus=2))  # now the whole service fits
    admitted = wait_until(
        lambda: cluster.condition("gang", "GangAdmitted"),
        "GangAdmitted says Kueue admitted the group",
        WAIT_S,
        until=lambda c: c.get("reason") == "KueueAdmitted",
    )
    assert admitted["status"] == "True" and "released together" in admitted["message"], admitted
    bound = wait_until(
        lambda: _engines(cluster),
        "prefill and decode ungated and bound",
        WAIT_S,
        until=lambda ps: len(ps) == 2 and all(not _gated(p) and p["spec"].get("nodeName") for p in ps),
    )
    assert sorted(p["metadata"]["labels"][names.LABEL_ROLE] for p in bound) == ["decode", "prefill"]
    cluster.wait_ready("gang")
