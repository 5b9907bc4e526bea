"""What render() produces is accepted by the router's and the connector's own config parsers
(docs/contracts.md §2-3): the operator and the other parts agree on keys and values."""

from __future__ import annotations

import json

import pytest
import yaml
from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference

router_config = pytest.importorskip("kvferry.router.config")
connector_config = pytest.importorskip("kvferry.connector.config")


@pytest.mark.parametrize("connector", ["kvferry", "vllm"])
def test_router_config_parses_with_the_routers_parser(connector: str) -> None:
    objs = render(make_inference("c", namespace="ns").kv(connector=connector).obj()).objects
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    parsed = router_config.parse_config(yaml.safe_load(cm["data"]["router.yaml"]))
    assert parsed.kubernetes.prefill_service == "c-prefill"


def test_kvferry_extra_config_parses_with_the_connectors_parser() -> None:
    objs = render(make_inference("k", accelerator="p5en").obj()).objects
    for role in ("prefill", "decode"):
        sts = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == f"k-{role}")
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        kv = json.loads(args[args.index("--kv-transfer-config") + 1].replace("$(POD_IP)", "10.0.0.7"))
        cfg = connector_config.KvferryConfig.from_extra(kv["kv_connector_extra_config"])
        assert (cfg.backends, cfg.side_channel_host) == (["LIBFABRIC"], "10.0.0.7")
