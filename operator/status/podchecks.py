"""Pod checks step: pods that cannot start, from their own status (pure).

Two findings: an image the kubelet cannot pull (ErrImagePull / ImagePullBackOff on any of the CR's pods,
router included), named with the image so the fix is obvious; and engine pods that stopped at
start-up with a kvferry termination message.

With `kvTransfer.connectorSource: inject` an engine pod runs two kvferry steps before vLLM: the init
container `kvferry inject` and the start-up `kvferry preflight --startup`. Each writes one line to its
container's termination message when it refuses to go on (an old vLLM or NIXL, a missing plugin). The
kubelet keeps it in the pod status; here it becomes TransferHealthy=False with a reason a person can act
on, instead of an anonymous CrashLoopBackOff.
"""

from __future__ import annotations

from typing import Any

from kvferry.contracts import termination
from kvferry.operator.spec import names
from kvferry.operator.status.conditions import Reason

# The prefixes connector/preflight.py and connector/inject.py write (kvferry.contracts.termination).
MARKERS = (
    (termination.PREFLIGHT_FAILED, Reason.PREFLIGHT_FAILED),
    (termination.INJECT_FAILED, Reason.INJECT_FAILED),
)
MAX_MESSAGE = 600  # condition messages stay readable in `kubectl describe`
# Waiting reasons of a container whose image the kubelet cannot get (kubelet images/types.go).
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")


def pull_failure(pods: list[dict[str, Any]]) -> tuple[Reason, str] | None:
    """The images the CR's pods wait for and cannot pull, each with the pods that wait for it."""
    found: dict[str, list[str]] = {}
    why: dict[str, str] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta, st = pod["metadata"], pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") not in PULL_FAILURES:
                continue
            image = cs.get("image") or "?"
            found.setdefault(image, []).append(f"{meta['name']}/{cs.get('name', '?')}")
            why.setdefault(image, f"{waiting['reason']}: {(waiting.get('message') or '').strip()}")
    if not found:
        return None
    parts = []
    for image, where in found.items():
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        parts.append(f"image {image} cannot be pulled by {shown} ({why[image][:MAX_MESSAGE]})")
    return Reason.IMAGE_PULL_FAILED, "; ".join(parts)


def _terminations(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(container name, terminated state) of containers that are not running now."""
    st = pod.get("status") or {}
    out = []
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        state, last = cs.get("state") or {}, cs.get("lastState") or {}
        if "running" in state:
            continue  # restarted and got past its start-up step
        terminated = state.get("terminated") or last.get("terminated")
        if terminated and terminated.get("exitCode", 0) != 0:
            out.append((cs.get("name", "?"), terminated))
    return out


def start_failure(pods: list[dict[str, Any]]) -> tuple[Reason, str] | None:
    """An image pull failure first (nothing else can start), else the first kvferry start-up refusal
    among the engine pods, with the pods that share it."""
    if (pull := pull_failure(pods)) is not None:
        return pull
    found: dict[tuple[Reason, str], list[str]] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta = pod["metadata"]
        if meta.get("labels", {}).get(names.LABEL_ROLE) not in names.ROLES or meta.get("deletionTimestamp"):
            continue
        for container, terminated in _terminations(pod):
            message = (terminated.get("message") or "").strip()
            for prefix, reason in MARKERS:
                if message.startswith(prefix):
                    key = (reason, message.removeprefix(prefix)[:MAX_MESSAGE])
                    found.setdefault(key, []).append(f"{meta['name']}/{container}")
    if not found:
        return None
    (reason, detail), where = next(iter(found.items()))
    shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
    return reason, f"{shown} refused to start: {detail}"
