"""The Argo CD health script (manifests/gitops/argocd-health.lua) run in Lua 5.1, as Argo CD runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lupa import lua51

SCRIPT = Path(__file__).resolve().parents[3] / "manifests" / "gitops" / "argocd-health.lua"


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """Run the script with `obj` as Argo CD's global and return (status, message)."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPT.read_text())
    return result["status"], result["message"]


def cond(type_: str, status: str, reason: str = "", message: str = "", gen: int | None = 3) -> dict[str, Any]:
    c = {"type": type_, "status": status, "reason": reason, "message": message}
    if gen is not None:
        c["observedGeneration"] = gen
    return c


def inference(
    generation: int = 3, observed: int | None = 3, conditions: list | None = None
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "kvferry.io/v1alpha1",
        "kind": "DisaggregatedInference",
        "metadata": {"name": "qwen", "generation": generation},
    }
    if observed is not None or conditions is not None:
        obj["status"] = {"conditions": conditions or []}
        if observed is not None:
            obj["status"]["observedGeneration"] = observed
    return obj


def test_no_status_is_progressing() -> None:
    assert health(inference(observed=None))[0] == "Progressing"


def test_unobserved_generation_is_progressing_even_if_ready() -> None:
    status, message = health(inference(generation=4, observed=3, conditions=[cond("Ready", "True")]))
    assert status == "Progressing"
    assert "generation 4" in message


def test_ready_true_is_healthy() -> None:
    ready = cond("Ready", "True", "AllRolesReady", "2/2 prefill, 4/4 decode")
    status, message = health(inference(conditions=[ready, cond("TransferHealthy", "True")]))
    assert (status, message) == ("Healthy", "Ready=True (AllRolesReady): 2/2 prefill, 4/4 decode")


def test_ready_condition_from_an_older_generation_is_ignored() -> None:
    status, _ = health(inference(generation=5, observed=5, conditions=[cond("Ready", "True", gen=4)]))
    assert status == "Progressing"


def test_degraded_wins_over_ready() -> None:
    conditions = [cond("Ready", "True"), cond("Degraded", "True", "PodsCrashLooping", "decode-1 restarts")]
    status, message = health(inference(conditions=conditions))
    assert status == "Degraded"
    assert "PodsCrashLooping" in message


@pytest.mark.parametrize("reason", ["UCXOnEFA", "TransferFailures"])
def test_failing_transfers_are_degraded_while_pods_are_ready(reason: str) -> None:
    conditions = [cond("Ready", "True"), cond("TransferHealthy", "False", reason)]
    status, message = health(inference(conditions=conditions))
    assert status == "Degraded"
    assert reason in message


def test_rolling_out_reports_the_progressing_reason() -> None:
    conditions = [
        cond("Ready", "False", "RolesNotReady"),
        cond("Progressing", "True", "RollingOut", "decode 1/4"),
    ]
    status, message = health(inference(conditions=conditions))
    assert status == "Progressing"
    assert message == "Progressing=True (RollingOut): decode 1/4"


def test_transfer_unknown_does_not_block_health() -> None:
    conditions = [cond("Ready", "True"), cond("TransferHealthy", "Unknown", "NoTrafficYet")]
    assert health(inference(conditions=conditions))[0] == "Healthy"


def test_the_argocd_cm_patch_carries_exactly_this_script() -> None:
    import yaml

    patch = yaml.safe_load((SCRIPT.parent / "argocd-cm.yaml").read_text())
    assert patch["data"] == {
        "resource.customizations.health.kvferry.io_DisaggregatedInference": SCRIPT.read_text()
    }
