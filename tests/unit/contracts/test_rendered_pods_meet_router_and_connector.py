"""What the operator renders into engine pods (docs/contracts.md §3) is what the router and the connector
look for: the router discovers the rendered Services' endpoints by their port names and pairs by the
revision label; vLLM finds the connector class at the rendered module path; the wire protocol version
the revision covers is the connector's."""

from __future__ import annotations

import importlib
import json

from kvferry.contracts import labels, pods, versions
from kvferry.operator.render.objects import render
from kvferry.router.discovery import endpoints_from_slices

from tests.unit.operator.cases import make_inference


def _by_kind(objs: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def test_the_router_discovers_rendered_engines_by_port_name_and_revision() -> None:
    rendered = render(make_inference("c", namespace="ns").obj())
    service = _by_kind(rendered.objects, "Service", "c-decode")
    pod_template = _by_kind(rendered.objects, "StatefulSet", "c-decode")["spec"]["template"]
    assert {p["name"] for p in pod_template["spec"]["containers"][0]["ports"]} >= {
        p["targetPort"] for p in service["spec"]["ports"]
    }
    # An EndpointSlice carries its Service's port names; the pod keeps its template's labels.
    endpoint_slice = {
        "ports": [{"name": p["name"], "port": p["port"]} for p in service["spec"]["ports"]],
        "endpoints": [{"addresses": ["10.0.0.7"], "targetRef": {"kind": "Pod", "name": "c-decode-0"}}],
    }
    pod_labels = {"c-decode-0": pod_template["metadata"]["labels"]}
    (found,) = endpoints_from_slices([endpoint_slice], pod_labels, "decode", 1, labels.REVISION)
    assert (found.url, found.side_port, found.revision) == ("http://10.0.0.7:8000", 5600, rendered.revision)


def test_vllm_finds_the_connector_at_the_rendered_module_path() -> None:
    sts = _by_kind(render(make_inference("k").obj()).objects, "StatefulSet", "k-prefill")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    connector = getattr(importlib.import_module(kv["kv_connector_module_path"]), kv["kv_connector"])
    assert connector.__name__ == pods.CONNECTOR_CLASS
    assert callable(importlib.import_module(pods.PREFLIGHT_MODULE).main)


def test_the_revision_covers_the_connectors_wire_protocol() -> None:
    from kvferry.connector.wire import PROTOCOL_VERSION

    assert PROTOCOL_VERSION == versions.WIRE_PROTOCOL_VERSION
