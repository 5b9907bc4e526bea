"""manifests/install.yaml with `kubectl apply`, then every example; the API server validates them all."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kvferry.local.controlplane import ControlPlane

from tests.cluster.installkit import EXAMPLES, ROOT, apply_yaml, get_json
from tests.waiting import wait_until

INSTALL = ROOT / "manifests" / "install.yaml"
INSTALL_NAMESPACE = "kvferry-system"


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane, kubeconfig: Path) -> Iterator[None]:
    # --force-conflicts: another test's Helm release may own the CRD's labels; kubectl takes them over,
    # as a user switching install paths would.
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(INSTALL), timeout_s=120)
    try:
        yield
    finally:
        # CRDs and the namespace stay: other tests share them (the operator tests use kvferry-system).
        docs = [d for d in yaml.safe_load_all(INSTALL.read_text()) if d]
        mine = [d for d in docs if d["kind"] not in ("CustomResourceDefinition", "Namespace")]
        control_plane.kubectl(
            "delete", "--ignore-not-found", "-f", "-", input=yaml.safe_dump_all(mine), check=False
        )


def test_install_yaml_brings_up_the_operator_deployment(control_plane: ControlPlane, installed: None) -> None:
    def available() -> bool:
        dep = get_json(control_plane, "deployment", "kvferry", "-n", INSTALL_NAMESPACE)
        return dep["status"].get("availableReplicas") == 1

    wait_until(available, "kvferry Deployment available (kwok runs the pod)", 60)
    crd = get_json(control_plane, "crd", "disaggregatedinferences.kvferry.io")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    sa = get_json(control_plane, "serviceaccount", "kvferry", "-n", INSTALL_NAMESPACE)
    assert sa["metadata"]["name"] == "kvferry"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_each_example_is_accepted(
    control_plane: ControlPlane, installed: None, namespace: str, path: Path
) -> None:
    res = control_plane.kubectl("apply", "--server-side", "-n", namespace, "-f", str(path))
    doc = yaml.safe_load(path.read_text())
    assert f"disaggregatedinference.kvferry.io/{doc['metadata']['name']} serverside-applied" in res.stdout
    stored = get_json(control_plane, "disaggregatedinference", doc["metadata"]["name"], "-n", namespace)
    for key, value in doc["spec"].items():
        if isinstance(value, dict):
            assert value.items() <= stored["spec"][key].items(), (
                key
            )  # defaults may add keys, never change ours
        else:
            assert stored["spec"][key] == value


def test_an_example_broken_against_a_cel_rule_is_rejected_with_its_message(
    control_plane: ControlPlane, installed: None, namespace: str
) -> None:
    doc = yaml.safe_load((EXAMPLES / "p5en-qwen3-32b-1p1d.yaml").read_text())
    broken = copy.deepcopy(doc)
    broken["spec"]["kvTransfer"]["backends"] = ["UCX"]
    res = control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(broken), check=False
    )
    assert res.returncode != 0
    assert "UCX silently falls back to TCP on EFA" in res.stderr
    assert "backends must be [LIBFABRIC]" in res.stderr
    assert apply_yaml(control_plane, namespace, doc).endswith("created")
