"""What stops EFA pods before their first token reaches the CR's conditions (real control plane + operator).

1. An image the kubelet cannot pull: the test writes the pod status the kubelet would (ImagePullBackOff
   with the image; kwok pulls nothing) and the operator names the image and the fix (ImagePullFailed).
2. A memory-lock limit too small for EFA: the pods export kvferry_preflight_ok{check="memlock"} 0, as the
   connector's start-up preflight does (connector/preflight.py), and TransferHealthy says to run as
   UID 0 with IPC_LOCK or raise LimitMEMLOCK.
"""

from __future__ import annotations

from kubernetes.client.rest import ApiException
from kvferry.contracts import metrics as m

from tests.cluster.engine_metrics import prometheus
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

IMAGE = "registry.invalid/kvferry/vllm:0.32.0-kvferry0.1.0"


def _pull_backoff(pod_name: str) -> dict:
    """The status the kubelet writes for a container whose image pull keeps failing."""
    waiting = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{IMAGE}"'}
    container = {"name": "vllm", "image": IMAGE, "imageID": "", "ready": False, "restartCount": 0}
    return {"status": {"containerStatuses": [{**container, "started": False, "state": {"waiting": waiting}}]}}


def _patch(cluster, pod_name: str) -> bool:
    try:
        cluster.core.patch_namespaced_pod_status(pod_name, cluster.ns, _pull_backoff(pod_name))
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def test_an_unpullable_image_is_named_with_the_fix(cluster, operator) -> None:
    cluster.apply(make_inference("pull", image=IMAGE).obj())
    wait_until(lambda: cluster.pods("pull", "decode"), "decode pod created")

    def named() -> bool:
        _patch(cluster, "pull-decode-0")  # re-written each poll: kwok may write its own status
        return cluster.condition("pull", "TransferHealthy").get("reason") == "ImagePullFailed"

    wait_until(named, "TransferHealthy reason ImagePullFailed", interval_s=1.0)
    health = cluster.condition("pull", "TransferHealthy")
    assert health["status"] == "False"
    assert f"image {IMAGE} cannot be pulled by pull-decode-0/vllm (ImagePullBackOff" in health["message"]
    assert "image.registry" in health["message"] and "imagePullSecrets" in health["message"]


def test_a_memlock_limit_too_small_says_how_to_lift_it(cluster, start_operator, fake_metrics) -> None:
    start_operator("--metrics-interval", "1", "--metrics-url", fake_metrics.url)
    refused = f'# TYPE {m.PREFLIGHT_OK} gauge\n{m.PREFLIGHT_OK}{{{m.CHECK}="{m.CHECK_MEMLOCK}"}} 0\n'
    fake_metrics.texts = {
        "lock-prefill-0": prometheus(0, 0) + refused,
        "lock-decode-0": prometheus(0, 0) + refused,
    }
    cluster.apply(make_inference("lock", accelerator="p5en").obj())
    wait_until(
        lambda: cluster.condition("lock", "TransferHealthy").get("reason") == "PreflightFailed",
        "TransferHealthy reason PreflightFailed",
    )
    message = cluster.condition("lock", "TransferHealthy")["message"]
    assert f"prefill {m.CHECK_MEMLOCK}" in message and f"decode {m.CHECK_MEMLOCK}" in message
    assert "memlock: run the engine as UID 0 with IPC_LOCK" in message
    assert "LimitMEMLOCK=infinity" in message
