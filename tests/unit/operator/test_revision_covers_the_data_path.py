"""The revision covers everything that changes the data path, so the router never pairs old and new
connectors: engine images, the injector image with connectorSource inject, the wire protocol version
(pinned in docs/contracts.md, equal to the connector's own)."""

from __future__ import annotations

import re
from pathlib import Path

from kvferry.contracts import versions
from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference

CONTRACTS = Path(__file__).resolve().parents[3] / "docs" / "contracts.md"


def test_inject_mode_revision_moves_with_the_injector_image() -> None:
    cr = make_inference("inj", image="vllm/vllm-openai:v0.32.0").kv(connectorSource="inject").obj()
    old = render(cr, router_image="ghcr.io/kvferry/operator:0.1.0")
    new = render(cr, router_image="ghcr.io/kvferry/operator:0.2.0")
    assert old.revision != new.revision
    cr["spec"]["router"] = {"image": "registry.example/kvferry:9"}  # the CR's own injector image
    assert render(cr, router_image="a:1").revision == render(cr, router_image="b:2").revision
    assert render(cr).revision not in (old.revision, new.revision)


def test_image_mode_revision_ignores_the_operator_image() -> None:
    cr = make_inference("img").obj()
    assert render(cr, router_image="op:1").revision == render(cr, router_image="op:2").revision


def test_revision_moves_with_the_wire_protocol_version(monkeypatch) -> None:
    cr = make_inference("p").obj()
    upstream = make_inference("u", accelerator="p5").kv(connector="vllm").obj()  # no kvferry wire
    before = render(cr).revision, render(upstream).revision
    monkeypatch.setattr(versions, "WIRE_PROTOCOL_VERSION", versions.WIRE_PROTOCOL_VERSION + 1)
    assert render(cr).revision != before[0]
    assert render(upstream).revision == before[1]


def test_protocol_version_agrees_with_the_connector_and_the_contract() -> None:
    from kvferry.connector.wire import PROTOCOL_VERSION  # the test may import both sides

    pinned = re.search(r"Connector wire protocol version: \*\*(\d+)\*\*", CONTRACTS.read_text())
    assert pinned, "docs/contracts.md §3 must pin the connector wire protocol version"
    assert int(pinned.group(1)) == versions.WIRE_PROTOCOL_VERSION == PROTOCOL_VERSION
