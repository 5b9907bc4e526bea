"""dashboards/kvferry.json queries only metrics that exist: documented in docs/metrics.md and exported
by the connector (kvferry_*), or exported by the installed vLLM (vllm:*)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from kvferry.connector.metrics import SPECS

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = json.loads((ROOT / "dashboards" / "kvferry.json").read_text())
METRIC = re.compile(r"\b(kvferry_[a-z_]+|vllm:[a-z_]+)")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def queried() -> set[str]:
    return {m for panel in DASHBOARD["panels"] for t in panel["targets"] for m in METRIC.findall(t["expr"])}


def base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def documented() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return {base(m) for m in re.findall(r"^\| `(kvferry_[a-z_]+)`", text, re.M)}


def exported_by_connector() -> set[str]:
    return {spec.name for spec in SPECS}


def exported_by_vllm() -> set[str]:
    """Metric names in the installed vLLM's metrics code (read as text: importing vLLM loads torch)."""
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.submodule_search_locations, "vLLM is not installed (scripts/setup.sh)"
    code = Path(spec.submodule_search_locations[0]) / "v1" / "metrics"
    return set(re.findall(r'"(vllm:[a-z_]+)"', "".join(p.read_text() for p in code.glob("*.py"))))


def test_every_kvferry_metric_is_documented_and_exported() -> None:
    used = {base(m) for m in queried() if m.startswith("kvferry_")}
    assert used, "the dashboard queries no kvferry metric"
    assert used - documented() == set(), "not in docs/metrics.md"
    assert used - exported_by_connector() == set(), "not exported by connector/"


def test_every_vllm_metric_exists_in_the_installed_vllm() -> None:
    used = {base(m) for m in queried() if m.startswith("vllm:")}
    assert used, "the dashboard queries no vLLM metric"
    assert used - exported_by_vllm() == set()


def test_the_panels_cover_what_operators_ask_for() -> None:
    titles = " | ".join(p["title"] for p in DASHBOARD["panels"]).lower()
    for topic in (
        "ttft",
        "tpot",
        "transfers / s",
        "p50 / p99",
        "failures by reason",
        "pending registrations",
    ):
        assert topic in titles, topic
    assert "per nixl backend" in titles


def test_every_query_uses_the_datasource_variable_and_unique_ids() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
