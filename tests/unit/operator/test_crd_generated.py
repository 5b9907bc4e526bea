"""The committed CRD, API reference, chart templates and install.yaml are exactly what `kvferry generate`
makes from operator/spec/, codegen/rbac.py and the chart."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from kvferry.codegen import crdgen, generate
from kvferry.operator import spec


def test_committed_files_equal_a_fresh_generation(capsys) -> None:
    assert generate.main(["--check"]) == 0, capsys.readouterr().err


def test_crd_carries_subresources_columns_and_every_rule() -> None:
    crd = yaml.safe_load((generate.ROOT / "crds" / "disaggregatedinferences.yaml").read_text())
    assert crd == crdgen.crd()
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:7] == ["Mode", "Prefill", "Decode", "Ready", "Transfers", "Failed", "Xfer-P50"]
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert len(spec_schema["x-kubernetes-validations"]) == len(spec.RULES)
    assert spec_schema["properties"]["decode"]["properties"]["replicas"]["minimum"] == 1
    assert spec_schema["properties"]["kvTransfer"]["default"] == {}


def _checkout_sources(root: Path) -> None:
    """The non-generated inputs the generator reads from a checkout: the chart and the Argo CD script."""
    shutil.copytree(generate.ROOT / generate.CHART, root / generate.CHART)
    (root / generate.ARGOCD_HEALTH).parent.mkdir(parents=True)
    shutil.copy(generate.ROOT / generate.ARGOCD_HEALTH, root / generate.ARGOCD_HEALTH)


def test_check_names_every_stale_file_and_one_run_fixes_them(tmp_path: Path, capsys) -> None:
    _checkout_sources(tmp_path)
    (tmp_path / "crds").mkdir()
    (tmp_path / "crds" / "dropped.yaml").write_text("# a CRD no longer generated\n")
    (tmp_path / generate.RBAC_TEMPLATE).write_text("stale\n")
    assert generate.main(["--root", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "stale: crds/disaggregatedinferences.yaml (missing)" in err
    assert f"stale: {generate.RBAC_TEMPLATE} (differs)" in err
    assert "stale: crds/dropped.yaml (left over" in err
    assert f"stale: {generate.INSTALL} (missing)" in err
    assert generate.main(["--root", str(tmp_path)]) == 0
    assert not (tmp_path / "crds" / "dropped.yaml").exists()
    assert generate.main(["--root", str(tmp_path), "--check"]) == 0
