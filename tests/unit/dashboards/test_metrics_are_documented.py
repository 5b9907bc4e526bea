"""docs/metrics.md documents every kvferry_ metric the connector, router and operator register, with
the type and labels the code gives it (and documents nothing they do not register)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kvferry.connector.metrics import Metrics
from kvferry.operator.runtime import selfmetrics
from kvferry.router.metrics import RouterMetrics
from prometheus_client import CollectorRegistry

DOC = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text()
ROW = re.compile(r"^\| `(kvferry_[a-z_]+)` \| (\w+) \|([^|]*)\|", re.M)
SUFFIX = {"counter": "_total"}


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    return {
        name: (kind, tuple(sorted(re.findall(r"`([a-z_]+)`", labels))))
        for name, kind, labels in ROW.findall(DOC)
    }


def registered(registry: CollectorRegistry) -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for collector in registry._collector_to_names:  # prometheus_client keeps no public list of them
        kind = collector._type
        name = collector._name + SUFFIX.get(kind, "")
        out[name] = (kind, tuple(sorted(collector._labelnames)))
    return out


REGISTRIES = {
    "connector": lambda: Metrics().registry,
    "router": lambda: RouterMetrics().registry,
    "operator": lambda: selfmetrics.REGISTRY,
}


@pytest.mark.parametrize("process", REGISTRIES)
def test_every_registered_metric_is_documented_with_its_type_and_labels(process: str) -> None:
    docs = documented()
    for name, want in registered(REGISTRIES[process]()).items():
        assert name in docs, f"{process} metric {name} is not in docs/metrics.md"
        assert docs[name] == want, f"{name}: docs say {docs[name]}, code registers {want}"


def test_nothing_documented_is_missing_from_the_code() -> None:
    code = {name for make in REGISTRIES.values() for name in registered(make())}
    assert set(documented()) - code == set()
