"""Apply step: server-side apply of rendered objects under the field manager `kvferry`, plus the few reads.

One small client over the kubernetes package's ApiClient (no discovery round-trips: the kinds the operator
touches are a fixed table). It counts requests so benchmarks can report API calls per reconcile.

Conflicts: an apply first goes without `force`; on 409 it is repeated with `force=true`. The reconcile
applies only objects that are absent or controlled by the CR (reconcile.foreign_owner), and the rendered
objects only hold fields the operator owns, so forcing only takes those back (a hand edit of the image,
say); fields we never render (HPA-owned replicas, other controllers' annotations) are never touched.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client, config
from kvferry.operator import names
from kvferry.operator.spec import GROUP, PLURAL, VERSION

# kind -> (API prefix, plural); everything the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "Secret": ("/api/v1", "secrets"),  # read as metadata only (Kube.exists): never the data
    "DisaggregatedInference": (f"/apis/{GROUP}/{VERSION}", PLURAL),
    "ClusterKopfPeering": ("/apis/kopf.dev/v1", "clusterkopfpeerings"),  # leader election (peering.py)
    "KopfPeering": ("/apis/kopf.dev/v1", "kopfpeerings"),
}
# The kinds a CR's render produces (tests/unit/operator/test_render.py keeps this in step with render).
RENDERED_KINDS = (
    "ConfigMap",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "Service",
    "StatefulSet",
    "PodDisruptionBudget",
    "Deployment",
    "NetworkPolicy",
)
# Accept header for a GET that returns only metadata (PartialObjectMetadata), used for Secrets.
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
REQUEST_TIMEOUT_S = 30.0  # every call is bounded; kopf retries the handler on timeouts


class KubeError(RuntimeError):
    """An API call failed; `status` is the HTTP status (0 for transport errors), `causes` the API
    server's machine-readable cause reasons (e.g. "NamespaceTerminating")."""

    def __init__(self, status: int, message: str, causes: tuple[str, ...] = ()):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.causes = causes

    @property
    def namespace_terminating(self) -> bool:
        """The namespace is being deleted: nothing can be created there, and retrying cannot help."""
        return "NamespaceTerminating" in self.causes


@dataclass
class Kube:
    """The operator's API client: SSA apply, get, list, status patch; with request counters."""

    api: client.ApiClient
    requests: Counter = field(default_factory=Counter)  # "VERB kind" -> count
    forbidden: Counter = field(default_factory=Counter)  # 403s by "VERB kind": RBAC gaps show up here
    on_request: Callable[[str, str, int], None] | None = None  # (verb, kind, HTTP status) hook for metrics
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_kubeconfig(cls, path: str | None = None) -> Kube:
        return cls(client.ApiClient(load_configuration(path)))

    def close(self) -> None:
        self.api.close()

    def total_requests(self) -> int:
        with self._lock:
            return sum(self.requests.values())

    # --- paths ---

    @staticmethod
    def path(kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        parts = [prefix] + ([f"namespaces/{quote(namespace)}"] if namespace else []) + [plural]
        parts += [quote(name)] if name else []
        parts += [sub] if sub else []
        return "/".join(parts)

    # --- calls ---

    def _call(
        self,
        method: str,
        kind: str,
        path: str,
        *,
        query: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests[f"{method} {kind}"] += 1
        url = path + ("?" + urlencode(query) if query else "")
        headers = {"Accept": accept, "Content-Type": content_type}
        req = self.api.param_serialize(
            method=method, resource_path=url, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            resp = self.api.call_api(*req, _request_timeout=REQUEST_TIMEOUT_S)
            resp.read()
        except Exception as exc:  # urllib3 transport errors: report, kopf retries
            raise KubeError(0, f"{method} {url}: {exc}") from exc
        data = json.loads(resp.data) if resp.data else {}
        if self.on_request is not None:
            self.on_request(method, kind, resp.status)
        if resp.status == 403:
            with self._lock:
                self.forbidden[f"{method} {kind}"] += 1
        return resp.status, data

    def _ok(self, status: int, data: dict[str, Any], what: str) -> dict[str, Any]:
        if status >= 400:
            causes = tuple(c.get("reason", "") for c in (data.get("details") or {}).get("causes") or [])
            raise KubeError(status, f"{what}: {data.get('message', data)}", causes)
        return data

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` as field manager `kvferry`; returns the object as stored."""
        meta = obj["metadata"]
        path = self.path(obj["kind"], meta.get("namespace"), meta["name"])
        query = {"fieldManager": names.FIELD_MANAGER}
        ctype = "application/apply-patch+yaml"  # JSON is YAML; the server accepts it as an apply patch
        status, data = self._call("PATCH", obj["kind"], path, query=query, body=obj, content_type=ctype)
        if status == 409:
            status, data = self._call(
                "PATCH", obj["kind"], path, query={**query, "force": "true"}, body=obj, content_type=ctype
            )
        return self._ok(status, data, f"apply {obj['kind']} {meta.get('namespace')}/{meta['name']}")

    def create_if_missing(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless it exists (HTTP 409); True when this call created it."""
        meta = obj["metadata"]
        status, data = self._call(
            "POST", obj["kind"], self.path(obj["kind"], meta.get("namespace")), body=obj
        )
        if status == 409:
            return False
        self._ok(status, data, f"create {obj['kind']} {meta.get('namespace') or ''}/{meta['name']}")
        return True

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        status, data = self._call("GET", kind, self.path(kind, namespace, name))
        return None if status == 404 else self._ok(status, data, f"get {kind} {namespace}/{name}")

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        """Whether an object exists, reading only its metadata (for Secrets: the data never arrives)."""
        status, data = self._call("GET", kind, self.path(kind, namespace, name), accept=METADATA_ONLY)
        if status == 404:
            return False
        self._ok(status, data, f"get {kind} {namespace}/{name} (metadata)")
        return True

    def list(self, kind: str, namespace: str | None, selector: dict[str, str]) -> list[dict[str, Any]]:
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())}
        status, data = self._call("GET", kind, self.path(kind, namespace), query=query)
        return self._ok(status, data, f"list {kind} in {namespace}").get("items", [])

    def patch_status(
        self, namespace: str, name: str, status_patch: dict[str, Any], resource_version: str | None = None
    ) -> dict[str, Any]:
        """JSON merge patch of the CR's status subresource (kopf never writes there: handlers return None).

        With `resource_version` the patch only applies to that version (409 otherwise): status is
        written by the reconcile and the metrics timer, and each must build on what the other wrote.
        """
        path = self.path("DisaggregatedInference", namespace, name, "status")
        body: dict[str, Any] = {"status": status_patch}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        code, data = self._call(
            "PATCH",
            "DisaggregatedInference/status",
            path,
            body=body,
            content_type="application/merge-patch+json",
        )
        return self._ok(code, data, f"patch status {namespace}/{name}")


def load_configuration(path: str | None = None) -> client.Configuration:
    """`path` if given, else in-cluster credentials, else $KUBECONFIG read now.

    (The kubernetes package reads KUBECONFIG once at import, so a value set later would be ignored.)
    """
    cfg = client.Configuration()
    if path:
        config.load_kube_config(config_file=path, client_configuration=cfg)
        return cfg
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None
        config.load_kube_config(config_file=env, client_configuration=cfg)
    return cfg


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
