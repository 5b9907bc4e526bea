"""`kvferry render`: prints every object offline; invalid CRs exit 2 naming the field."""

from __future__ import annotations

from pathlib import Path

import yaml
from kvferry.operator.render.cli import main

EXAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "examples"


def test_render_prints_all_objects_of_every_example(capsys) -> None:
    examples = sorted(str(p) for p in EXAMPLES.glob("*.yaml"))
    assert examples
    assert main(examples) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    crs = sum(
        1
        for p in examples
        for d in yaml.safe_load_all(Path(p).read_text())
        if d and d.get("kind") == "DisaggregatedInference"
    )
    assert len(docs) == 14 * crs  # 12 workload objects + 2 NetworkPolicies
    assert all("ownerReferences" not in d["metadata"] for d in docs)


def test_invalid_cr_exits_2_naming_the_field(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "kind": "DisaggregatedInference",
                "metadata": {"name": "b"},
                "spec": {"model": "m", "decode": {"replicas": 0}},
            }
        )
    )
    assert main([str(bad)]) == 2
    assert "spec.decode.replicas" in capsys.readouterr().err


def test_revision_flag_prints_one_hash_per_cr(tmp_path, capsys) -> None:
    path = tmp_path / "cr.yaml"
    path.write_text(
        yaml.safe_dump({"kind": "DisaggregatedInference", "metadata": {"name": "r"}, "spec": {"model": "m"}})
    )
    assert main(["--revision", str(path)]) == 0
    name, rev = capsys.readouterr().out.split()
    assert name == "r" and len(rev) == 10
