"""Apply step: server-side apply of rendered objects under the field manager `kvferry`, plus the few reads.

One small client over the kubernetes package's ApiClient (no discovery round-trips: the kinds the operator
touches are a fixed table). It counts requests so benchmarks can report API calls per reconcile. It is the
operator's one client for its own reads and writes (and `kvferry release-finalizers`'); kopf's client
serves only kopf's machinery (watches, its progress annotations and finalizer, events).

Never over someone else's object: `apply` writes only where the object's own controller owner reference
(the CR, set by render) controls what holds the name, and the write is conditional on what was observed.
It reads the name (a list by name: the object, or the collection's resourceVersion when it is absent)
and sends that resourceVersion with the apply. The API server rejects an apply whose resourceVersion is
not the stored object's (409), and creates an absent object whatever resourceVersion it carries; an
object that appeared since the read has a later resourceVersion than the read, so it is never merged
into. On such a 409 the name is read again and checked again: a foreign object raises `NotControlled`.
(A plain POST would also be create-only, but it records the fields under an Update entry of `kvferry`,
so fields the operator later stops rendering would never be removed by its applies.)

Every other write (a StatefulSet's /scale, an engine pod's labels, a CR's finalizers) goes through
`write_owned`: the same check (`not_controlled`: the target's controller owner reference carries the
expected owner's UID) on the object as read, and a merge patch conditional on that read's
resourceVersion and uid. Nothing writes by name alone.

Conflicts: an apply first goes without `force`; on a field-manager conflict it is repeated with
`force=true`. The rendered objects only hold fields the operator owns, so forcing only takes those back
(a hand edit of the image, say); fields we never render (HPA-owned replicas, other controllers'
annotations) are never touched.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client, config
from kvferry.operator.spec import GROUP, PLURAL, VERSION, names

# kind -> (API prefix, plural); everything the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "Node": ("/api/v1", "nodes"),  # read only: its EC2 network-node labels (network.py)
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    # A role wider than one node (render/groups.py); the CRD comes with LWS, applied only when rendered.
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    # A role's EFA (and GPUs) through DRA (render/dra.py); applied only when rendered.
    "ResourceClaimTemplate": ("/apis/resource.k8s.io/v1", "resourceclaimtemplates"),
    # A gang's pod group as Kueue admits it (status/gang.py reads it; Kueue's storage version since 0.15).
    "Workload": ("/apis/kueue.x-k8s.io/v1beta2", "workloads"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    # read as metadata only (Kube.exists, Kube.metadata): never the data; created only by create_owned
    # (the CR's transfer token, reconcile/token.py), never updated
    "Secret": ("/api/v1", "secrets"),
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


class NotControlled(KubeError):
    """The name is held by an object the applied object's controller does not control: nothing was
    written. The message names the object and its owner (the reconcile reports it as Conflict)."""

    def __init__(self, message: str):
        super().__init__(409, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


APPLY_ATTEMPTS = 4  # reads + conditional applies of one object before giving up (it keeps changing)
DISCOVERY_TTL_S = 60.0  # how long Kube.serves() trusts an answer: installing Kueue shows within a minute
# A resourceVersion no stored object has: an etcd store starts at revision 1 and every write moves it on,
# so objects carry 2 and up. An apply carrying it can only create.
NEVER_STORED = "1"


def controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The controller owner reference of `obj`, if any."""
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def not_controlled(
    existing: dict[str, Any], owner_uid: str, kind: str, owner: str = "the operator's"
) -> str | None:
    """THE ownership check: why `existing` is not the operator's to write as `owner_uid`'s, or None.

    Writable: the owner itself (a CR's own finalizers) and what its controller owner reference names
    by UID. A name proves nothing: a CR `db` renders `db-prefill`, which may be another team's.
    """
    meta = existing.get("metadata") or {}
    have = controller(existing)
    if owner_uid and (meta.get("uid") == owner_uid or (have and have.get("uid") == owner_uid)):
        return None
    who = f"{have.get('kind')} {have.get('name')}" if have else "no controller"
    return f"{kind} {meta.get('name')} exists and is not {owner} (owner: {who})"


def not_ours(existing: dict[str, Any], obj: dict[str, Any]) -> str | None:
    """Why `existing` (what holds `obj`'s name) is not controlled by `obj`'s controller, or None."""
    want = controller(obj)
    owner = f"this {want['kind']}'s" if want else "the operator's"
    return not_controlled(existing, (want or {}).get("uid", ""), obj["kind"], owner)


@dataclass
class Kube:
    """The operator's API client: SSA apply, get, list, status patch; with request counters."""

    api: client.ApiClient
    requests: Counter[str] = field(default_factory=Counter)  # "VERB kind" -> count
    forbidden: Counter[str] = field(default_factory=Counter)  # 403s by "VERB kind": RBAC gaps show up here
    on_request: Callable[[str, str, int], None] | None = None  # (verb, kind, HTTP status) hook for metrics
    # (namespace, name) -> the CR as the operator's last status write stored it, packed (status/publish.py)
    written: dict[tuple[str, str], bytes] = field(default_factory=dict)
    # API group -> (monotonic time read, served): discovery answers, kept DISCOVERY_TTL_S (serves()).
    discovered: dict[str, tuple[float, bool]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def from_kubeconfig(cls, path: str | None = None) -> Kube:
        return cls(client.ApiClient(load_configuration(path)))

    def close(self) -> None:
        self.api.close()  # type: ignore[no-untyped-call]  # the kubernetes package leaves it unannotated

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
            resp.read()  # type: ignore[no-untyped-call]  # unannotated in the kubernetes package
        except Exception as exc:  # urllib3 transport errors: report, kopf retries
            raise KubeError(0, f"{method} {url}: {exc}") from exc
        raw = resp.data or b""
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:  # not JSON: the API server's plain "404 page not found" of an unserved path
            data = {"message": raw[:200].decode("utf-8", errors="replace").strip()}
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

    def observe(self, kind: str, namespace: str | None, name: str) -> tuple[dict[str, Any] | None, str]:
        """What holds a name now: (the object or None, the resourceVersion a write must be based on).

        A list by name, so an absent object still yields a version (the collection's at that read).
        """
        query = {"fieldSelector": f"metadata.name={name}"}
        status, data = self._call("GET", kind, self.path(kind, namespace), query=query)
        data = self._ok(status, data, f"read {kind} {namespace}/{name}")
        items = data.get("items") or []
        found = items[0] if items else None
        return found, (found or data)["metadata"].get("resourceVersion", "")

    def apply(self, obj: dict[str, Any], *, absent: bool = False) -> dict[str, Any]:
        """Server-side apply `obj` as field manager `kvferry`; returns the object as stored.

        Only over an object `obj`'s controller owner reference controls, or to create an absent one:
        raises NotControlled (and writes nothing) when something else holds the name, even if it
        appeared a moment before the write (see the module docstring).

        absent: the caller's watch holds no object of this name. The read is skipped and the apply
        carries a resourceVersion no stored object has: it creates the object in one request, and
        anything that holds the name makes it fail (409) untouched, after which the usual read,
        check and conditional apply run.
        """
        kind, meta = obj["kind"], obj["metadata"]
        ns, name = meta.get("namespace"), meta["name"]
        what = f"apply {kind} {ns}/{name}"
        if absent:
            status, data = self._apply_at(obj, NEVER_STORED, force=False)
            if status != 409:
                return self._ok(status, data, what)
            # Something holds the name after all (the watch was behind, or a foreign object): as below.
        for _ in range(APPLY_ATTEMPTS):
            existing, version = self.observe(kind, ns, name)
            if existing is not None and (why := not_ours(existing, obj)) is not None:
                raise NotControlled(why)
            status, data = self._apply_at(obj, version, force=False)
            if status == 409 and _field_conflict(data):
                status, data = self._apply_at(obj, version, force=True)
            if status != 409 or _field_conflict(data):
                return self._ok(status, data, what)
            # 409 without a field conflict: the object changed since `observe`; look at it again.
        raise KubeError(409, f"{what}: the object kept changing while being applied")

    def _apply_at(self, obj: dict[str, Any], version: str, *, force: bool) -> tuple[int, dict[str, Any]]:
        """One apply conditional on `version` (the stored object's resourceVersion must equal it)."""
        meta = obj["metadata"]
        body = {**obj, "metadata": {**meta, "resourceVersion": version}}
        query = {"fieldManager": names.FIELD_MANAGER, **({"force": "true"} if force else {})}
        ctype = "application/apply-patch+yaml"  # JSON is YAML; the server accepts it as an apply patch
        path = self.path(obj["kind"], meta.get("namespace"), meta["name"])
        return self._call("PATCH", obj["kind"], path, query=query, body=body, content_type=ctype)

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

    def create_owned(self, obj: dict[str, Any], owner_uid: str) -> bool:
        """Create `obj` (its controller owner reference names `owner_uid`) unless its name is taken;
        True when this call created it, False when the name holds `owner_uid`'s own object (left as it
        is: create-if-absent never updates, so a Secret's data is never replaced). Something else of
        that name raises NotControlled, by `not_controlled` on its metadata (for a Secret the data
        never arrives). Nothing is written over an existing object."""
        if self.create_if_missing(obj):
            return True
        kind, meta = obj["kind"], obj["metadata"]
        existing = self.metadata(kind, meta["namespace"], meta["name"])
        if existing is None:  # deleted since the create's 409: the next reconcile creates it
            raise KubeError(409, f"create {kind} {meta['namespace']}/{meta['name']}: deleted meanwhile")
        if (why := not_controlled(existing, owner_uid, kind, "this DisaggregatedInference's")) is not None:
            raise NotControlled(why)
        return False

    def metadata(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """An object's metadata only (PartialObjectMetadata: for a Secret, never its data); None if absent."""
        status, data = self._call("GET", kind, self.path(kind, namespace, name), accept=METADATA_ONLY)
        return None if status == 404 else self._ok(status, data, f"get {kind} {namespace}/{name} (metadata)")

    def serves(self, group: str) -> bool:
        """Whether the API server serves API group `group` (e.g. Kueue is installed). One discovery
        read per group per DISCOVERY_TTL_S, so reconciles add no requests for it most of the time."""
        now = time.monotonic()
        cached = self.discovered.get(group)
        if cached is not None and now - cached[0] < DISCOVERY_TTL_S:
            return cached[1]
        status, data = self._call("GET", "APIGroup", f"/apis/{quote(group)}")
        served = status != 404
        if served:
            self._ok(status, data, f"discover API group {group}")
        self.discovered[group] = (now, served)
        return served

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
        items: list[dict[str, Any]] = self._ok(status, data, f"list {kind} in {namespace}").get("items", [])
        return items

    def write_owned(
        self,
        kind: str,
        based_on: dict[str, Any],
        owner_uid: str,
        patch: dict[str, Any],
        *,
        sub: str | None = None,
        what: str = "patch",
    ) -> dict[str, Any]:
        """The one door for every write that is not an apply: a JSON merge patch of `based_on` (the
        `kind` object as read), only if `not_controlled` finds it `owner_uid`'s, and only
        over that read's resourceVersion (409 if it changed since: the caller reads and decides
        again), so an object replaced by someone else's since the read is never written.
        Raises NotControlled (nothing written) or KubeError."""
        meta = based_on["metadata"]
        ns, name = meta.get("namespace"), meta["name"]
        if (why := not_controlled(based_on, owner_uid, kind)) is not None:
            raise NotControlled(f"{what} {kind} {ns}/{name} refused: {why}")
        body = {
            **patch,
            "metadata": {**patch.get("metadata", {}), "resourceVersion": meta["resourceVersion"]},
        }
        if meta.get("uid"):  # the API server refuses a uid change (422): a same-named new object fails
            body["metadata"]["uid"] = meta["uid"]
        code, data = self._call(
            "PATCH",
            kind if sub is None else f"{kind}/{sub}",
            self.path(kind, ns, name, sub),
            query={"fieldManager": names.FIELD_MANAGER},
            body=body,
            content_type="application/merge-patch+json",
        )
        return self._ok(code, data, f"{what} {kind} {ns}/{name}")

    def patch_labels(
        self, kind: str, based_on: dict[str, Any], owner_uid: str, labels: dict[str, str]
    ) -> dict[str, Any]:
        """Merge some labels into an object we do not render (an engine pod, owner_uid its
        StatefulSet's: network.py) under the field manager `kvferry`; other labels are left as they are."""
        return self.write_owned(kind, based_on, owner_uid, {"metadata": {"labels": labels}}, what="label")

    def scale(self, based_on: dict[str, Any], owner_uid: str, replicas: int) -> dict[str, Any]:
        """Set a StatefulSet's replicas through its /scale subresource (RBAC: statefulsets/scale)."""
        patch = {"spec": {"replicas": replicas}}
        return self.write_owned("StatefulSet", based_on, owner_uid, patch, sub="scale", what="scale")

    def set_finalizers(self, cr: dict[str, Any], finalizers: Sequence[str]) -> dict[str, Any]:
        """Replace a CR's finalizers (the CR is its own owner here), over the CR as read."""
        patch = {"metadata": {"finalizers": [*finalizers] or None}}
        uid = cr["metadata"].get("uid", "")
        return self.write_owned("DisaggregatedInference", cr, uid, patch, what="set finalizers of")

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


def _field_conflict(data: dict[str, Any]) -> bool:
    """Whether a 409 is server-side apply's field-manager conflict (not a resourceVersion mismatch)."""
    causes = (data.get("details") or {}).get("causes") or []
    return any(c.get("reason") == "FieldManagerConflict" for c in causes)


def load_configuration(path: str | None = None) -> client.Configuration:
    """`path` if given, else in-cluster credentials, else $KUBECONFIG read now.

    (The kubernetes package reads KUBECONFIG once at import, so a value set later would be ignored.)
    """
    cfg = client.Configuration()
    if path:
        _load_kube_config(config_file=path, client_configuration=cfg)
        return cfg
    try:
        _load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None
        _load_kube_config(config_file=env, client_configuration=cfg)
    return cfg


# The kubernetes package's config loaders carry no annotations: their types, written once.
_load_kube_config: Callable[..., None] = config.load_kube_config
_load_incluster_config: Callable[..., None] = config.load_incluster_config


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
