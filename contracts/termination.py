"""Termination messages: how a kvferry start-up step tells the operator why an engine pod stopped.

`kvferry inject` (init container) and `kvferry preflight --startup` (before vLLM) write one line,
starting with their prefix, to the container's termination log; the kubelet keeps it in the pod
status and the operator (operator/status/podchecks.py) turns it into a condition reason.
"""

from __future__ import annotations

PREFLIGHT_FAILED = "kvferry preflight failed: "  # connector/preflight.py -> Reason PreflightFailed
INJECT_FAILED = "kvferry inject failed: "  # connector/inject.py -> Reason ConnectorInjectFailed
# The kubelet keeps at most 4 KiB of a termination message; writers cut their line to this.
MAX_CHARS = 4000
