"""Golden render tests: each golden/<case>/input.yaml renders to exactly golden/<case>/expected/*.yaml."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from kvferry.operator.render.objects import render

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "input.yaml").exists())
UPDATE = os.environ.get("KVFERRY_UPDATE_GOLDEN") == "1"


def _file_name(obj: dict) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


@pytest.mark.parametrize("case", CASES)
def test_render_matches_golden(case: str) -> None:
    cr = yaml.safe_load((GOLDEN / case / "input.yaml").read_text())
    rendered = {_file_name(o): o for o in render(cr).objects}
    expected_dir = GOLDEN / case / "expected"
    if UPDATE:
        for old in expected_dir.glob("*.yaml"):
            old.unlink()
        for name, obj in rendered.items():
            (expected_dir / name).write_text(yaml.safe_dump(obj, sort_keys=False, width=120))
    expected = {p.name: yaml.safe_load(p.read_text()) for p in expected_dir.glob("*.yaml")}
    assert sorted(rendered) == sorted(expected)
    for name, obj in rendered.items():
        assert obj == expected[name], f"{case}/{name} differs; refresh with KVFERRY_UPDATE_GOLDEN=1"
