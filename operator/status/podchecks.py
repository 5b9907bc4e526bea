"""Pod checks step: engine pods that stopped at start-up with a kvferry termination message (pure).

With `kvTransfer.connectorSource: inject` an engine pod runs two kvferry steps before vLLM: the init
container `kvferry inject` and the start-up `kvferry preflight --startup`. Each writes one line to its
container's termination message when it refuses to go on (an old vLLM or NIXL, a missing plugin). The
kubelet keeps it in the pod status; here it becomes TransferHealthy=False with a reason a person can act
on, instead of an anonymous CrashLoopBackOff.
"""

from __future__ import annotations

from typing import Any

from kvferry.contracts import termination
from kvferry.operator import names
from kvferry.operator.status.conditions import Reason

# The prefixes connector/preflight.py and tools/inject.py write (kvferry.contracts.termination).
MARKERS = (
    (termination.PREFLIGHT_FAILED, Reason.PREFLIGHT_FAILED),
    (termination.INJECT_FAILED, Reason.INJECT_FAILED),
)
MAX_MESSAGE = 600  # condition messages stay readable in `kubectl describe`


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
    """The first kvferry start-up refusal among the engine pods, with the pods that share it."""
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
