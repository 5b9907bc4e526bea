"""The optional engine PodMonitor (real `helm template`): off by default, and when on it selects exactly
the pods the operator renders for prefill and decode (labels from operator/spec/names.py), on port http."""

from __future__ import annotations

import yaml
from kvferry.codegen import generate, helm
from kvferry.operator.render import images
from kvferry.operator.render.objects import render as render_cr
from kvferry.operator.spec import names

from tests.unit.operator.cases import make_inference


def _chart(*set_values: str) -> list[dict]:
    registry = f"image.registry={images.DEFAULT_REGISTRY}"  # the chart requires one
    chart = generate.ROOT / generate.CHART
    text = helm.template(chart, namespace="kvferry-system", set_values=(registry, *set_values))
    return [d for d in yaml.safe_load_all(text) if d]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def test_off_by_default() -> None:
    assert not [d for d in _chart() if d["kind"] == "PodMonitor"]


def test_selects_engine_pods_only_on_their_http_port() -> None:
    (monitor,) = [d for d in _chart("metrics.enginePodMonitor.enabled=true") if d["kind"] == "PodMonitor"]
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    assert (
        spec["podMetricsEndpoints"][0]["port"] == "http"
        and spec["podMetricsEndpoints"][0]["path"] == "/metrics"
    )
    objs = render_cr(make_inference("m", namespace="ns").obj()).objects
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objs
        if o["kind"] in ("StatefulSet", "Deployment")
    }
    selected = {name for name, labels in pods.items() if _selects(spec["selector"], labels)}
    assert selected == {names.role_name("m", "prefill"), names.role_name("m", "decode")}
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    ports = sts["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "http", "containerPort": names.HTTP_PORT, "protocol": "TCP"} in ports


def test_watched_namespaces_only_with_namespace_scope() -> None:
    docs = _chart(
        "metrics.enginePodMonitor.enabled=true",
        "operator.watch.scope=namespaces",
        "operator.watch.namespaces={a,b}",
    )
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
