"""Read the doctor's Snapshot with the kubernetes client (the user's kubeconfig); every call is bounded."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from kubernetes import client, config
from kvferry.tools.doctor.checks import Snapshot
from kvferry.tools.doctor.needs import Needs

TIMEOUT_S = 30
OPERATOR_SELECTOR = "app.kubernetes.io/name=kvferry,app.kubernetes.io/component=operator"


def api_client(kubeconfig: str | None, context: str | None = None) -> client.ApiClient:
    api: client.ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig, context=context
    )
    return api


class DoctorApiError(RuntimeError):
    def __init__(self, status: int, path: str, message: str) -> None:
        super().__init__(f"GET {path}: HTTP {status} {message}")
        self.status = status


def get(api: client.ApiClient, path: str, query: dict[str, str] | None = None) -> dict[str, Any]:
    """GET `path` as plain JSON (as the API server writes it), bounded by TIMEOUT_S."""
    url = path + ("?" + urlencode(query) if query else "")
    req = api.param_serialize(
        method="GET",
        resource_path=url,
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    resp = api.call_api(*req, _request_timeout=TIMEOUT_S)
    resp.read()  # type: ignore[no-untyped-call]
    raw: bytes = resp.data or b""
    try:
        data: dict[str, Any] = json.loads(raw) if raw else {}
    except ValueError:  # the API server's plain "404 page not found" of an unserved path
        data = {"message": raw[:200].decode("utf-8", errors="replace")}
    if resp.status >= 400:
        raise DoctorApiError(resp.status, path, str(data.get("message", "")))
    return data


def _items(api: client.ApiClient, path: str, query: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """A list's items; a kind the server does not serve (404, e.g. resource.k8s.io before 1.34) is empty."""
    try:
        items: list[dict[str, Any]] = get(api, path, query).get("items") or []
    except DoctorApiError as exc:
        if exc.status == 404:
            return []
        raise
    return items


def _ns(path: str, namespace: str | None) -> str:
    group, plural = path.rsplit("/", 1)
    return f"{group}/namespaces/{namespace}/{plural}" if namespace else path


def snapshot(api: client.ApiClient, needs: Needs, addons_namespace: str | None = None) -> Snapshot:
    """Everything the checks read. addons_namespace: where to look for the operator, device plugins and
    schedulers; None = every namespace."""
    selector = ",".join(f"{k}={v}" for k, v in needs.labels.items())
    return Snapshot(
        crds={
            c["metadata"]["name"]
            for c in _items(api, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
        },
        operators=_items(
            api, _ns("/apis/apps/v1/deployments", addons_namespace), {"labelSelector": OPERATOR_SELECTOR}
        ),
        nodes=_items(api, "/api/v1/nodes"),
        daemonsets=_items(api, _ns("/apis/apps/v1/daemonsets", addons_namespace)),
        deployments=_items(api, _ns("/apis/apps/v1/deployments", addons_namespace)),
        slices=_items(api, "/apis/resource.k8s.io/v1/resourceslices"),
        device_classes={c["metadata"]["name"] for c in _items(api, "/apis/resource.k8s.io/v1/deviceclasses")},
        pods=_items(api, f"/api/v1/namespaces/{needs.namespace}/pods", {"labelSelector": selector}),
        events=_items(api, f"/api/v1/namespaces/{needs.namespace}/events"),
    )
