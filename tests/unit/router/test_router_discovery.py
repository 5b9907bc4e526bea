"""Kubernetes discovery against a tiny fake API: every API call carries a timeout (pure logic)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvferry.router import discovery as disc
from kvferry.router.config import KubernetesDiscoveryConfig

SLICE = {
    "metadata": {"name": "x-decode-abc"},
    "ports": [{"name": "http", "port": 8000}, {"name": "side-channel", "port": 5600}],
    "endpoints": [
        {
            "addresses": ["10.0.0.5"],
            "conditions": {"ready": True},
            "targetRef": {"kind": "Pod", "name": "x-1"},
        },
    ],
}


class FakeApi:
    """Stands in for ApiClient, DiscoveryV1Api and CoreV1Api at once; records each call's kwargs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def list_namespaced_pod(self, namespace: str, **kw: Any) -> Any:
        self.calls.append(("pods", kw))
        pod = SimpleNamespace(metadata=SimpleNamespace(name="x-1", labels={"kvferry.io/revision": "r1"}))
        return SimpleNamespace(items=[pod])

    def list_namespaced_endpoint_slice(self, namespace: str, **kw: Any) -> Any:
        self.calls.append(("slices", kw))
        return SimpleNamespace(items=[SLICE])

    def sanitize_for_serialization(self, obj: Any) -> Any:
        return obj


def test_every_api_call_has_a_request_timeout() -> None:
    cfg = KubernetesDiscoveryConfig(namespace="ns", prefill_service="x-prefill", decode_service="x-decode")
    kd = disc.KubernetesDiscovery(cfg)
    fake = FakeApi()
    kd._api = (fake, fake, fake)
    pool = kd.refresh()
    assert [c[0] for c in fake.calls] == ["pods", "slices", "slices"]
    assert all(kw.get("_request_timeout") == disc.API_TIMEOUT_S for _, kw in fake.calls), fake.calls
    assert 0 < disc.API_TIMEOUT_S <= 30
    assert [e.revision for e in pool.decode] == ["r1"]
