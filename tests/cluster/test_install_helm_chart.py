"""The Helm chart against the real API server: dry-run in every mode, install, upgrade, uninstall."""

from __future__ import annotations

import json

import pytest
from kvferry.codegen import helm
from kvferry.local.controlplane import ControlPlane

from tests.cluster.installkit import CHART, TEST_REGISTRY, get_json, helm_install, unique

CRD = "disaggregatedinferences.kvferry.io"


@pytest.mark.parametrize(
    "settings",
    [
        (),
        ("operator.watch.scope=namespaces",),
        ("operator.replicas=2", "operator.leaderElection.enabled=true", "crds.keep=false"),
        ("metrics.enabled=false", "serviceAccount.name=custom", "operator.image.digest=sha256:" + "0" * 64),
    ],
    ids=["defaults", "namespaced", "leader-election", "no-metrics"],
)
def test_every_mode_renders_objects_the_api_server_accepts(
    control_plane: ControlPlane, namespace: str, settings: tuple[str, ...]
) -> None:
    registry = f"image.registry={TEST_REGISTRY}"  # required by the chart; a setting may override it
    rendered = helm.template(CHART, release="kvferry", namespace=namespace, set_values=(registry, *settings))
    res = control_plane.kubectl(
        "apply", "--dry-run=server", "--server-side", "--force-conflicts", "-f", "-", input=rendered
    )
    reported = res.stdout.splitlines()
    assert any("deployment.apps/kvferry" in line for line in reported), res.stdout
    assert any(f"customresourcedefinition.apiextensions.k8s.io/{CRD}" in line for line in reported)


def test_install_upgrade_uninstall_keeps_the_crd(control_plane: ControlPlane, namespace: str) -> None:
    release = unique("kvferry")
    helm_install(control_plane, release, namespace, wait=True)
    deployment = get_json(control_plane, "deployment", release, "-n", namespace)
    assert deployment["status"].get("availableReplicas") == 1
    crd = get_json(control_plane, "crd", CRD)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
    assert get_json(control_plane, "clusterrole", release)["rules"]

    helm_install(control_plane, release, namespace, "operator.image.tag=0.1.1", upgrade=True, wait=True)
    deployment = get_json(control_plane, "deployment", release, "-n", namespace)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.1.1")
    history = json.loads(control_plane.helm("history", release, "-n", namespace, "-o", "json").stdout)
    assert [h["status"] for h in history] == ["superseded", "deployed"]

    res = control_plane.helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s")
    assert "kept due to the resource policy" in res.stdout + res.stderr
    gone = control_plane.kubectl("get", "deployment", release, "-n", namespace, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    assert control_plane.kubectl("get", "clusterrole", release, check=False).returncode != 0
    assert get_json(control_plane, "crd", CRD)["metadata"]["name"] == CRD  # kept, as Helm keeps crds/


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("operator.replicas=two", "at '/operator/replicas': got string, want integer"),
        ("operator.watch.scope=everywhere", "at '/operator/watch/scope': value must be one of"),
        ("crds.kepp=true", "at '/crds': additional properties 'kepp' not allowed"),
    ],
)
def test_a_wrong_value_is_rejected_before_anything_is_installed(
    control_plane: ControlPlane, namespace: str, setting: str, complaint: str
) -> None:
    release = unique("kvferry")
    with pytest.raises(Exception) as err:
        helm_install(control_plane, release, namespace, setting)
    helm_said = str(err.value).split("failed (rc=", 1)[1]  # past the echoed command line
    assert "don't meet the specifications of the schema" in helm_said
    assert complaint in helm_said
    listed = json.loads(control_plane.helm("list", "-n", namespace, "-a", "-o", "json").stdout)
    assert listed == []
    assert control_plane.kubectl("get", "clusterrole", release, check=False).returncode != 0
