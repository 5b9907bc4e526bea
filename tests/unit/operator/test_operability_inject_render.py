"""connectorSource inject: the rendered engine pods copy the connector from the operator image, put it on
PYTHONPATH and run the start-up preflight before vLLM; the default renders none of it."""

from __future__ import annotations

import pytest
from kvferry.operator.render import injection
from kvferry.operator.render.objects import render
from kvferry.operator.spec import SpecError

from tests.unit.operator.cases import make_inference

ROUTER_IMAGE = "registry.example/kvferry:9.9"


def _engine(cr: dict, role: str = "decode") -> dict:
    objs = render(cr, router_image=ROUTER_IMAGE).objects
    return next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith(role))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_inject_adds_init_container_pythonpath_and_startup_preflight(role: str) -> None:
    cr = make_inference("inj", accelerator="p5en", image="vllm/vllm-openai:v0.32.0").kv(
        connectorSource="inject"
    )
    pod = _engine(cr.obj(), role)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == ROUTER_IMAGE and init["args"][:3] == ["inject", "--to", injection.INJECT_DIR]
    vllm = pod["containers"][0]
    assert vllm["image"] == "vllm/vllm-openai:v0.32.0"
    assert {"name": "PYTHONPATH", "value": injection.INJECT_DIR} in vllm["env"]
    assert {"name": injection.VOLUME, "mountPath": injection.INJECT_DIR, "readOnly": True} in vllm[
        "volumeMounts"
    ]
    assert any(v["name"] == injection.VOLUME and "emptyDir" in v for v in pod["volumes"])
    sh, dash_c, script, name = vllm["command"]
    assert (sh, dash_c, name) == ("sh", "-c", "vllm")
    # preflight first, for the preset's backend, then vLLM with the rendered args ("$@")
    assert script.startswith("python3 -m kvferry.connector.preflight --startup --backends LIBFABRIC")
    assert script.endswith('&& exec vllm serve "$@"')
    assert vllm["args"][0] == "/models/tiny"


def test_router_image_of_the_cr_is_the_injector() -> None:
    cr = make_inference("inj").kv(connectorSource="inject").router(image="mirror.example/kvferry:1").obj()
    assert _engine(cr)["spec"]["template"]["spec"]["initContainers"][0]["image"] == "mirror.example/kvferry:1"


def test_default_image_source_renders_no_injection() -> None:
    pod = _engine(make_inference("img").obj())["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert pod["containers"][0]["command"] == ["vllm", "serve"]
    assert all(e["name"] != "PYTHONPATH" for e in pod["containers"][0]["env"])


def test_switching_source_changes_the_revision_so_both_roles_roll_together() -> None:
    base = make_inference("rev")
    image = render(base.obj()).revision
    assert render(base.kv(connectorSource="image").obj()).revision == image  # explicit default: same
    assert render(base.kv(connectorSource="inject").obj()).revision != image


def test_inject_with_the_upstream_connector_is_rejected() -> None:
    cr = make_inference("bad").kv(connector="vllm", connectorSource="inject").obj()
    with pytest.raises(
        SpecError, match="spec.kvTransfer.connectorSource: .*needs kvTransfer.connector kvferry"
    ):
        render(cr)
