"""GitOps behaviour (docs/gitops.md): re-applies change nothing, the spec stays the user's, autoscalers win.

One chart install and one operator (as the chart's ServiceAccount) serve the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvferry.local.controlplane import ControlPlane

from tests.cluster.installkit import (
    RECONCILE_TIMEOUT_S,
    OperatorProcess,
    apply_yaml,
    example,
    get_json,
    helm_install,
    operator_as_chart_sa,
    unique,
    wait_reconciled,
)
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def gitops_ns(control_plane: ControlPlane, kubeconfig: Path) -> Iterator[str]:
    name = unique("gitops")
    control_plane.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(
    control_plane: ControlPlane, gitops_ns: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    release = unique("kvferry")
    helm_install(control_plane, release, gitops_ns)
    log = tmp_path_factory.mktemp("gitops") / "operator.log"
    try:
        with operator_as_chart_sa(control_plane, gitops_ns, release, log) as running:
            yield running
        assert running.forbidden_lines() == []
    finally:
        control_plane.helm("uninstall", release, "-n", gitops_ns, check=False)


def cr(plane: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return get_json(plane, "disaggregatedinference", name, "-n", ns, "--show-managed-fields")


def sts_generations(plane: ControlPlane, ns: str, name: str) -> dict[str, int]:
    return {
        role: get_json(plane, "statefulset", f"{name}-{role}", "-n", ns)["metadata"]["generation"]
        for role in ("prefill", "decode")
    }


def test_client_side_apply_twice_changes_nothing(
    control_plane: ControlPlane, gitops_ns: str, operator: OperatorProcess
) -> None:
    doc = example("cpu-tiny.yaml", cr_name="csa")
    assert apply_yaml(control_plane, gitops_ns, doc).endswith("created")
    first = wait_reconciled(control_plane, gitops_ns, "csa", operator)
    sts = sts_generations(control_plane, gitops_ns, "csa")
    assert apply_yaml(control_plane, gitops_ns, doc).endswith("unchanged")
    again = cr(control_plane, gitops_ns, "csa")
    assert again["metadata"]["generation"] == first["metadata"]["generation"]
    assert again["spec"] == first["spec"]
    assert sts_generations(control_plane, gitops_ns, "csa") == sts


def test_server_side_apply_twice_changes_nothing(
    control_plane: ControlPlane, gitops_ns: str, operator: OperatorProcess
) -> None:
    doc = example("cpu-tiny.yaml", cr_name="ssa")
    flags = ("--server-side", "--field-manager=argocd-controller")
    apply_yaml(control_plane, gitops_ns, doc, *flags)
    first = wait_reconciled(control_plane, gitops_ns, "ssa", operator)
    sts = sts_generations(control_plane, gitops_ns, "ssa")
    apply_yaml(control_plane, gitops_ns, doc, *flags)
    again = cr(control_plane, gitops_ns, "ssa")
    assert again["metadata"]["generation"] == first["metadata"]["generation"]
    assert again["spec"] == first["spec"]
    assert sts_generations(control_plane, gitops_ns, "ssa") == sts
    # The applier still owns every spec field it set: nobody took one over in between.
    (mine,) = [m for m in again["metadata"]["managedFields"] if m["manager"] == "argocd-controller"]
    assert "f:model" in mine["fieldsV1"]["f:spec"]


def test_the_operator_never_writes_the_spec(
    control_plane: ControlPlane, gitops_ns: str, operator: OperatorProcess
) -> None:
    doc = example("cpu-tiny.yaml", cr_name="owned")
    apply_yaml(control_plane, gitops_ns, doc, "--server-side", "--field-manager=flux")
    wait_reconciled(control_plane, gitops_ns, "owned", operator)
    entries = cr(control_plane, gitops_ns, "owned")["metadata"]["managedFields"]
    others = [m for m in entries if m["manager"] != "flux"]
    assert others, "the operator wrote nothing (no status?)"
    for entry in others:
        assert "f:spec" not in entry.get("fieldsV1", {}), f"{entry['manager']} wrote spec fields"
    assert any(m.get("subresource") == "status" for m in others)


def test_replicas_owned_by_an_autoscaler_are_left_alone(
    control_plane: ControlPlane, gitops_ns: str, operator: OperatorProcess
) -> None:
    doc = example("cpu-tiny.yaml", cr_name="hpa")
    doc["spec"]["decode"] = {"replicas": 1, "replicasOwner": "autoscaler"}
    apply_yaml(control_plane, gitops_ns, doc, "--server-side", "--field-manager=argocd-controller")
    wait_reconciled(control_plane, gitops_ns, "hpa", operator)
    # What an HPA does: write the scale subresource of the StatefulSet.
    control_plane.kubectl("scale", "statefulset", "hpa-decode", "--replicas=3", "-n", gitops_ns)
    # A Git change elsewhere in the spec makes the operator apply everything again.
    doc["spec"]["router"] = {"replicas": 2}
    apply_yaml(control_plane, gitops_ns, doc, "--server-side", "--field-manager=argocd-controller")
    wait_reconciled(control_plane, gitops_ns, "hpa", operator)
    wait_until(
        lambda: get_json(control_plane, "deployment", "hpa-router", "-n", gitops_ns)["spec"]["replicas"] == 2,
        "router scaled to 2 (the operator applied generation 2)",
        RECONCILE_TIMEOUT_S,
    )
    assert get_json(control_plane, "statefulset", "hpa-decode", "-n", gitops_ns)["spec"]["replicas"] == 3
    assert get_json(control_plane, "statefulset", "hpa-prefill", "-n", gitops_ns)["spec"]["replicas"] == 1
    assert cr(control_plane, gitops_ns, "hpa")["spec"]["decode"]["replicas"] == 1  # Git's value, untouched
