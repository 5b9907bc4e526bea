"""values.yaml is the chart's documentation and values.schema.json its contract: keep them in step.

Every key carries a comment, every key is in the schema (and nothing else is), every value is used by
a template, and the schema rejects wrong types and unknown keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

CHART = Path(__file__).resolve().parents[3] / "charts" / "kvferry"
VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
TEMPLATES = "\n".join(p.read_text() for p in (CHART / "templates").iterdir() if p.is_file())

# Maps whose keys are the user's (labels, selectors, resource names): their entries are not chart keys.
FREE_MAPS = {
    "operator.resources",
    "operator.podAnnotations",
    "operator.podLabels",
    "operator.nodeSelector",
    "operator.affinity",
    "serviceAccount.annotations",
    "metrics.service.annotations",
    "metrics.serviceMonitor.labels",
    "commonLabels",
}


def leaf_paths(data: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in FREE_MAPS:
            paths += leaf_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def schema_paths(schema: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        if sub.get("properties") and path not in FREE_MAPS:
            paths += schema_paths(sub, f"{path}.")
        else:
            paths.append(path)
    return paths


def test_every_key_has_a_comment_above_it() -> None:
    lines = VALUES_TEXT.splitlines()
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    undocumented = []
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w-]*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        stack = [(i, k) for i, k in stack if i < indent]
        parent = ".".join(k for _, k in stack)
        stack.append((indent, key))
        if any(parent == m or parent.startswith(m + ".") for m in FREE_MAPS):
            continue  # the user's own keys (e.g. resources.requests.cpu), shown as an example
        before = lines[number - 1].strip() if number else ""
        if not before.startswith("#"):
            undocumented.append(f"line {number + 1}: {line.strip()}")
    assert not undocumented, "keys without a comment above them:\n" + "\n".join(undocumented)


def test_values_and_schema_name_the_same_keys() -> None:
    values = set(leaf_paths(VALUES))
    schema = set(schema_paths(SCHEMA)) - {"global"}
    assert values - schema == set(), "keys in values.yaml missing from values.schema.json"
    assert schema - values == set(), "keys in values.schema.json missing from values.yaml"


def test_every_object_in_the_schema_forbids_unknown_keys() -> None:
    def walk(schema: dict[str, Any], path: str) -> list[str]:
        bad = []
        if schema.get("properties") and schema.get("additionalProperties") is not False:
            bad.append(path or "<root>")
        for key, sub in schema.get("properties", {}).items():
            bad += walk(sub, f"{path}.{key}" if path else key)
        return bad

    assert walk(SCHEMA, "") == []


def test_default_values_pass_the_schema() -> None:
    jsonschema.validate(VALUES, SCHEMA)


def test_every_value_is_used_by_a_template() -> None:
    unused = [p for p in leaf_paths(VALUES) if f".Values.{p}" not in TEMPLATES and not _used_via_parent(p)]
    assert unused == []


def _used_via_parent(path: str) -> bool:
    """Keys read through a parent binding, e.g. `$img := .Values.operator.image` then `$img.tag`."""
    parent, _, leaf = path.rpartition(".")
    return bool(parent) and f".Values.{parent} " in TEMPLATES and f".{leaf}" in TEMPLATES


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"operator": {"replicas": "two"}}, "'two' is not of type 'integer'"),
        ({"operator": {"replica": 2}}, "Additional properties are not allowed ('replica'"),
        ({"operator": {"watch": {"scope": "everything"}}}, "'everything' is not one of"),
        ({"crds": {"keep": "yes"}}, "'yes' is not of type 'boolean'"),
        ({"operator": {"image": {"digest": "latest"}}}, "does not match"),
        ({"metrics": {"port": 70000}}, "70000 is greater than the maximum"),
        ({"image": {"registry": "Registry.example.com/KV"}}, "does not match"),
        ({"operator": {"image": {"repository": "x/operator"}}}, "Additional properties are not allowed"),
    ],
)
def test_schema_rejects_bad_values(override: dict[str, Any], needle: str) -> None:
    merged = _merge(VALUES, override)
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(merged, SCHEMA)
    assert needle in str(err.value)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and key in base else value
    return out
