"""`kubectl describe` of a broken DisaggregatedInference says what to fix (real control plane + operator).

1. A decode pod whose start-up preflight refused the image (connectorSource inject): the test writes the
   pod status the kubelet would (a terminated vllm container with the preflight's termination message;
   kwok runs no containers), and the operator's status step turns it into PreflightFailed.
2. Pods reporting UCX on an EFA preset (metrics served from 127.0.0.1 through the operator's --metrics-url,
   as in test_operator_transfer_status).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes.client.rest import ApiException

from tests.cluster.test_operator_transfer_status import FakeMetrics, prometheus
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

REFUSAL = (
    "kvferry preflight failed: vllm_version: vLLM 0.26.0 is older than 0.32, the oldest the kvferry "
    "connector supports: use a vLLM >= 0.32 image (spec.image)"
)


@pytest.fixture
def metrics_server() -> Iterator[FakeMetrics]:
    server = FakeMetrics()
    yield server
    server.close()


@pytest.fixture
def metered_operator(start_operator, metrics_server):
    return start_operator("--metrics-interval", "1", "--metrics-url", metrics_server.url)


def _crashlooping(pod_name: str) -> dict:
    """The status the kubelet writes for a container that exited 1 at start-up and is backing off."""
    return {
        "status": {
            "containerStatuses": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.26.0",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 3,
                    "started": False,
                    "state": {
                        "waiting": {
                            "reason": "CrashLoopBackOff",
                            "message": f"back-off restarting {pod_name}",
                        }
                    },
                    "lastState": {
                        "terminated": {"exitCode": 1, "reason": "Error", "message": REFUSAL + "\n"}
                    },
                }
            ]
        }
    }


def _patch_crashlooping(cluster, pod_name: str) -> bool:
    try:
        cluster.core.patch_namespaced_pod_status(pod_name, cluster.ns, _crashlooping(pod_name))
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_describe_names_the_preflight_refusal_and_the_fix(cluster, operator) -> None:
    cr = make_inference("inj", image="vllm/vllm-openai:v0.26.0").kv(connectorSource="inject").obj()
    cluster.apply(cr)
    wait_until(lambda: cluster.pods("inj", "decode"), "decode pod created")
    pod = "inj-decode-0"

    def refused() -> bool:
        # Re-written each poll: kwok may write its own status for the pod meanwhile.
        _patch_crashlooping(cluster, pod)
        return cluster.condition("inj", "TransferHealthy").get("reason") == "PreflightFailed"

    wait_until(refused, "TransferHealthy reason PreflightFailed", interval_s=1.0)
    health = cluster.condition("inj", "TransferHealthy")
    assert health["status"] == "False"
    assert f"{pod}/vllm refused to start: vllm_version: vLLM 0.26.0 is older than 0.32" in health["message"]
    assert cluster.condition("inj", "Degraded")["reason"] == "TransferUnhealthy"

    out = cluster.kubectl("describe", "disaggregatedinference", "inj").stdout
    assert "PreflightFailed" in out, out
    assert "Fix: use a vLLM image whose vLLM and NIXL the connector supports" in out, out
    assert "TransferHealthChanged" in out, out  # the Warning event is listed too


def test_describe_says_set_backends_to_libfabric_for_ucx_on_efa(
    cluster, metered_operator, metrics_server
) -> None:
    metrics_server.texts = {
        "u-prefill-0": prometheus(10, 0, backend="UCX"),
        "u-decode-0": prometheus(0, 0, "UCX"),
    }
    cluster.apply(make_inference("u", accelerator="p5en").obj())
    wait_until(lambda: cluster.condition("u", "TransferHealthy").get("reason") == "UCXOnEFA", "UCXOnEFA")
    out = cluster.kubectl("describe", "disaggregatedinference", "u").stdout
    assert "UCXOnEFA" in out, out
    assert "prefill and decode pods run NIXL backend UCX on EFA nodes" in out, out
    assert "set spec.kvTransfer.backends to [LIBFABRIC]" in out, out
