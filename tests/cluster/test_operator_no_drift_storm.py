"""Watch events on owned objects that change nothing we render cause no re-apply and no DriftCorrected.

The StatefulSets carry quantities the API server stores in another spelling (65536Mi -> 64Gi,
8000m -> 8, as the p5 preset's 8 x 640Mi hugepages become 5Gi); each pod readiness flip is a
StatefulSet status event the operator sees. The operator's own /metrics count its applies (PATCH).
"""

from __future__ import annotations

import urllib.request

from kvferry.local.controlplane.processes import reserve_ports

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

FLIPS = 6
RESOURCES = {"requests": {"cpu": "8000m", "memory": "65536Mi"}, "limits": {"memory": "65536Mi"}}


def _applies(port: int) -> int:
    """Server-side applies the operator made: PATCHes of what it renders. Not the CR's status, and not
    the one-off label copy onto each engine pod (operator/reconcile/network.py), which its metrics timer makes
    whenever it first sees the pod bound: on a loaded host that can fall inside the flips."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("kvferry_operator_api_requests_total{")
        and 'verb="PATCH"' in line
        and "DisaggregatedInference" not in line
        and 'kind="Pod"' not in line
    )


def _set_ready(cluster, pod: str, ready: bool) -> None:
    status = "True" if ready else "False"
    cond = {"type": "Ready", "status": status, "lastTransitionTime": "2026-01-01T00:00:00Z"}
    cluster.core.patch_namespaced_pod_status(pod, cluster.ns, {"status": {"conditions": [cond]}})


def test_pod_readiness_flips_cause_no_reapply_and_no_drift_correction(cluster, start_operator) -> None:
    port = reserve_ports(1)[0]
    start_operator("--metrics-interval", "600", env={"KVFERRY_METRICS_PORT": str(port)})
    cr = make_inference("calm", accelerator="p5en").prefill(resources=RESOURCES).decode(resources=RESOURCES)
    cluster.apply(cr.obj())
    cluster.wait_ready("calm", "CR calm Ready")
    stored = cluster.get("statefulset", "calm-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert stored["resources"]["requests"]["memory"] == "64Gi"  # the server's spelling, not ours
    wait_until(lambda: _applies(port) == _applies(port), "operator idle", interval_s=2.0)
    before, versions = _applies(port), set()
    for i in range(FLIPS):
        _set_ready(cluster, "calm-decode-0", ready=i % 2 == 1)
        wait_until(
            lambda i=i: cluster.cr("calm")["status"]["decode"]["readyReplicas"] == i % 2,
            f"flip {i} seen in status",
            interval_s=0.3,
        )
        versions.add(cluster.get("statefulset", "calm-decode")["metadata"]["resourceVersion"])
    assert len(versions) >= FLIPS // 2, "the flips did not reach the StatefulSet"
    assert _applies(port) == before
    assert cluster.events("DriftCorrected") == []
