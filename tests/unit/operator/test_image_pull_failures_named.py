"""A pod whose image cannot be pulled becomes TransferHealthy=False/ImagePullFailed naming the image,
the pods and the fix, instead of pods that stay not-ready without a word (operator/status/podchecks.py)."""

from __future__ import annotations

from kvferry.connector.preflight import Check, failure_message
from kvferry.operator.status import podchecks, remedies
from kvferry.operator.status.conditions import Reason

IMAGE = "ghcr.io/kvferry/vllm:0.32.0-kvferry0.1.0"


def _pod(name: str, role: str, statuses: list[dict], init: list[dict] | None = None) -> dict:
    return {
        "metadata": {"name": name, "labels": {"kvferry.io/role": role}},
        "status": {"containerStatuses": statuses, "initContainerStatuses": init or []},
    }


def _waiting(reason: str, image: str = IMAGE, name: str = "vllm") -> dict:
    message = f'Back-off pulling image "{image}"'
    return {"name": name, "image": image, "state": {"waiting": {"reason": reason, "message": message}}}


def test_backoff_names_the_image_the_pods_and_the_fix() -> None:
    pods = [_pod(f"m-decode-{i}", "decode", [_waiting("ImagePullBackOff")]) for i in range(5)]
    pods.append(_pod("m-prefill-0", "prefill", [_waiting("ErrImagePull")]))
    reason, message = podchecks.start_failure(pods)
    assert reason is Reason.IMAGE_PULL_FAILED
    assert message.startswith(f"image {IMAGE} cannot be pulled by m-decode-0/vllm, m-decode-1/vllm")
    assert "and 3 more" in message and "Back-off pulling image" in message
    explained = remedies.explain(reason, message)
    assert "image.registry" in explained and "imagePullSecrets" in explained


def test_router_and_init_container_images_are_named_too() -> None:
    router = _pod("m-router-abc", "router", [_waiting("ImagePullBackOff", "ghcr.io/kvferry/operator:0.1.0")])
    init = _pod("m-prefill-0", "prefill", [], init=[_waiting("ErrImagePull", "op:1", "kvferry-inject")])
    _, message = podchecks.start_failure([router, init])
    assert "image ghcr.io/kvferry/operator:0.1.0 cannot be pulled by m-router-abc/vllm" in message
    assert "image op:1 cannot be pulled by m-prefill-0/kvferry-inject" in message


def test_a_pull_failure_comes_before_a_start_up_refusal_and_running_pods_are_quiet() -> None:
    refused = {
        "name": "vllm",
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": failure_message([Check("x", False, "y")])}},
    }
    pods = [
        _pod("m-prefill-0", "prefill", [refused]),
        _pod("m-decode-0", "decode", [_waiting("ErrImagePull")]),
    ]
    assert podchecks.start_failure(pods)[0] is Reason.IMAGE_PULL_FAILED
    assert podchecks.start_failure(pods[:1])[0] is Reason.PREFLIGHT_FAILED
    running = {"name": "vllm", "image": IMAGE, "state": {"running": {}}}
    assert podchecks.start_failure([_pod("m-decode-0", "decode", [running])]) is None
