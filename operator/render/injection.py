"""Connector injection: the kvferry connector in a stock vLLM image (`kvTransfer.connectorSource: inject`).

Pure (no kopf, no kubernetes). For a role it returns what the StatefulSet template adds:
- an init container from the operator image running `kvferry inject --to DIR` into an emptyDir;
- PYTHONPATH=DIR on the vLLM container, so `kv_connector_module_path: kvferry.connector` resolves;
- a start-up step before `vllm serve`: `python3 -m kvferry.connector.preflight --startup`, which exits
  with a termination message when the image's vLLM or NIXL cannot run the connector (connector/compat.py);
  the operator turns that message into TransferHealthy=False, reason PreflightFailed (podchecks.py).
"""

from __future__ import annotations

import shlex
from typing import Any

from kvferry.contracts import pods
from kvferry.operator.render.presets import PodPlan
from kvferry.operator.spec import Spec

INJECT_DIR = "/opt/kvferry-inject"
VOLUME = "kvferry-connector"
INIT_CONTAINER = "kvferry-inject"
TERMINATION_LOG = "/dev/termination-log"
# The init container only writes into the emptyDir: nothing else is needed.
INIT_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def startup_script(backends: list[str]) -> str:
    """Shell run as the vLLM container's command: preflight, then exec vLLM with the rendered args."""
    preflight = [
        "python3",
        "-m",
        pods.PREFLIGHT_MODULE,
        "--startup",
        "--backends",
        *backends,
        "--termination-log",
        TERMINATION_LOG,
    ]
    return f'{shlex.join(preflight)} && exec vllm serve "$@"'


def context(spec: Spec, plan: PodPlan, injector_image: str) -> dict[str, Any] | None:
    """Template additions for one role, or None when the image already holds the connector."""
    if spec.kv_transfer.connector_source != "inject":
        return None
    mount = {"name": VOLUME, "mountPath": INJECT_DIR, "readOnly": True}
    return {
        "init_container": {
            "name": INIT_CONTAINER,
            "image": injector_image,
            "command": ["kvferry"],
            "args": ["inject", "--to", INJECT_DIR, "--termination-log", TERMINATION_LOG],
            "volumeMounts": [{"name": VOLUME, "mountPath": INJECT_DIR}],
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
            "securityContext": INIT_SECURITY,
            "terminationMessagePolicy": "FallbackToLogsOnError",
        },
        "volume": {"name": VOLUME, "emptyDir": {"sizeLimit": "64Mi"}},
        "mount": mount,
        "env": [{"name": "PYTHONPATH", "value": INJECT_DIR}],
        # `sh -c SCRIPT NAME ARGS...`: "$@" in the script is the rendered vLLM args.
        "command": ["sh", "-c", startup_script(plan.backends), "vllm"],
    }
