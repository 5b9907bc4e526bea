"""The router Deployment gets default resource requests and limits (it rendered `resources: {}`: no
memory bound, best-effort QoS), and a CR's own spec.router.resources replace them whole."""

from __future__ import annotations

from typing import Any

from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference


def router_resources(obj: dict[str, Any]) -> dict[str, Any]:
    (deployment,) = [o for o in render(obj).objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container["resources"])


def test_the_router_has_default_requests_and_limits() -> None:
    got = router_resources(make_inference("r", namespace="ns", accelerator="cpu").obj())
    assert set(got) == {"requests", "limits"}
    assert {"cpu", "memory"} <= set(got["requests"]) and "memory" in got["limits"]


def test_a_crs_router_resources_replace_the_defaults() -> None:
    own = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    obj = make_inference("r", namespace="ns", accelerator="cpu").router(resources=own).obj()
    assert router_resources(obj) == own
