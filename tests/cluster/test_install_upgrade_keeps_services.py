"""`helm upgrade` to a new operator image keeps running P/D services as they are: no StatefulSet rollout."""

from __future__ import annotations

from pathlib import Path

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


def router_image(plane: ControlPlane, ns: str) -> str:
    deployment = get_json(plane, "deployment", "tiny-router", "-n", ns)
    return deployment["spec"]["template"]["spec"]["containers"][0]["image"]


def test_upgrading_the_operator_does_not_roll_the_engines(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    release = unique("kvferry")
    helm_install(control_plane, release, namespace, "operator.image.tag=0.1.0")
    with operator_as_chart_sa(control_plane, namespace, release, tmp_path / "old.log") as old:
        apply_yaml(control_plane, namespace, example("cpu-tiny.yaml"))
        wait_reconciled(control_plane, namespace, "tiny", old)
        wait_until(lambda: router_image(control_plane, namespace), "router Deployment", RECONCILE_TIMEOUT_S)
    assert old.forbidden_lines() == []
    before = {
        s["metadata"]["name"]: (s["metadata"]["generation"], s["spec"]["template"])
        for s in get_json(control_plane, "statefulsets", "-n", namespace)["items"]
    }
    assert router_image(control_plane, namespace).endswith(":0.1.0")

    helm_install(control_plane, release, namespace, "operator.image.tag=0.2.0", upgrade=True)
    with operator_as_chart_sa(control_plane, namespace, release, tmp_path / "new.log") as new:
        # The router runs the operator's image, so seeing it move proves the new operator reconciled.
        wait_until(
            lambda: router_image(control_plane, namespace).endswith(":0.2.0"),
            "router image follows the new operator",
            RECONCILE_TIMEOUT_S,
        )
        after = {
            s["metadata"]["name"]: (s["metadata"]["generation"], s["spec"]["template"])
            for s in get_json(control_plane, "statefulsets", "-n", namespace)["items"]
        }
    assert new.forbidden_lines() == []
    assert set(after) == {"tiny-prefill", "tiny-decode"}
    assert after == before
