"""The committed CRD and API reference are exactly what operator/spec.py generates."""

from __future__ import annotations

import yaml
from kvferry.operator import crdgen, spec


def test_committed_files_equal_a_fresh_generation() -> None:
    for rel, text in crdgen.outputs().items():
        committed = (crdgen.ROOT / rel).read_text()
        assert committed == text, f"{rel} is stale: run `kvferry crd`"


def test_crd_carries_subresources_columns_and_every_rule() -> None:
    crd = yaml.safe_load((crdgen.ROOT / crdgen.CRD_PATH).read_text())
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.decode.replicas"
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:7] == ["Mode", "Prefill", "Decode", "Ready", "Transfers", "Failed", "Xfer-P50"]
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert len(spec_schema["x-kubernetes-validations"]) == len(spec.RULES)
    assert spec_schema["properties"]["decode"]["properties"]["replicas"]["minimum"] == 1
    assert spec_schema["properties"]["kvTransfer"]["default"] == {}


def test_check_mode_reports_stale_files(tmp_path) -> None:
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 1
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--root", str(tmp_path), "--check"]) == 0
