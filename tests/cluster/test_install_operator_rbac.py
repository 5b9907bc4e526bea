"""The chart's ServiceAccount is enough for a full reconcile, and not more than the rules say.

The operator runs locally (no kubelet runs containers here) with the chart Deployment's environment and
a TokenRequest token of the chart's ServiceAccount, so every API call it makes is checked against the
chart's RBAC by the real API server.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvferry.local.controlplane import ControlPlane

from tests.cluster.installkit import (
    RECONCILE_TIMEOUT_S,
    apply_yaml,
    example,
    get_json,
    helm_install,
    operator_as_chart_sa,
    unique,
    wait_reconciled,
)
from tests.waiting import wait_until

# Everything the operator renders for one CR (operator/render/templates), by kind.
CHILD_KINDS = ("statefulsets", "services", "configmaps", "poddisruptionbudgets", "deployments", "roles")


@pytest.mark.parametrize("scope", ["cluster", "namespaces"])
def test_chart_service_account_reconciles_without_a_single_403(
    control_plane: ControlPlane, namespace: str, tmp_path: Path, scope: str
) -> None:
    release = unique("kvferry")
    helm_install(control_plane, release, namespace, f"operator.watch.scope={scope}")
    with operator_as_chart_sa(control_plane, namespace, release, tmp_path / "operator.log") as operator:
        apply_yaml(control_plane, namespace, example("cpu-tiny.yaml"))
        cr = wait_reconciled(control_plane, namespace, "tiny", operator)

        def children_and_status() -> bool:
            current = get_json(control_plane, "disaggregatedinference", "tiny", "-n", namespace)
            kinds_present = all(
                get_json(control_plane, kind, "-n", namespace, "-l", "kvferry.io/name=tiny")["items"]
                for kind in CHILD_KINDS
            )
            return kinds_present and bool(current.get("status", {}).get("conditions"))

        wait_until(children_and_status, "every child kind and status conditions", RECONCILE_TIMEOUT_S)
        assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]
        # Router RBAC could only be created because the operator holds what it grants (escalation check).
        router_role = get_json(control_plane, "role", "tiny-router", "-n", namespace)
        assert {r for rule in router_role["rules"] for r in rule["resources"]} == {"endpointslices", "pods"}
        assert operator.forbidden_lines() == []
        assert "# TYPE" in operator.metrics()  # what the chart's metrics Service points at is served
    assert operator.forbidden_lines() == []


def test_without_the_chart_rbac_the_same_run_is_refused(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    """Control for the test above: the 403 detection sees denials when RBAC is missing."""
    release = unique("kvferry")
    helm_install(control_plane, release, namespace, "rbac.create=false")
    log = tmp_path / "operator.log"
    with operator_as_chart_sa(control_plane, namespace, release, log, wait_healthy=False) as operator:
        apply_yaml(control_plane, namespace, example("cpu-tiny.yaml"))
        wait_until(operator.forbidden_lines, "a 403 in the operator log", 30)
        assert get_json(control_plane, "statefulsets", "-n", namespace)["items"] == []
