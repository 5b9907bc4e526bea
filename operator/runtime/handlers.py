"""Handlers step: the kopf table of contents. Each handler is a few lines that call reconcile/scrape.

- CR created/updated/resumed -> `reconcile` (render, apply, status).
- A managed StatefulSet/Deployment/Service/ConfigMap changes -> `changes` sorts the event: a shape
  change goes to `on_owned_change` (re-apply on drift or deletion), a status-only change asks the
  `coalesce` batcher for one status refresh of the CR, an event that changed neither does nothing.
- Timers per CR: transfer metrics (`scrape`) and a slow full resync (drift the watches missed).
- Shards: with KVFERRY_SHARD=i/n every handler, timer and index takes only the CRs `shard.owns`.
- Indexes: the CRs, their workloads by role, and every managed object ("copies"), so a reconcile
  writes only what differs from the watch's copy. CRs and copies are packed (operator/fleet/packed.py), the
  workloads trimmed to what status reads (`watched_copy`): memory at 1,000 CRs.
Handlers return None so kopf writes nothing into status; its progress lives in kvferry.io annotations.
Each handler is a named function (`Handlers` methods where it needs the configuration); `register` at
the end wires them, one kopf trigger and filter each.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
from kvferry.operator.autoscale import timer as autoscale_timer
from kvferry.operator.fleet.changes import Change, Changes
from kvferry.operator.fleet.coalesce import Coalescer
from kvferry.operator.fleet.latest import Latest
from kvferry.operator.fleet.packed import pack, unpack
from kvferry.operator.reconcile import network, steps
from kvferry.operator.reconcile.apply import RENDERED_KINDS, RESOURCES, Kube, load_configuration
from kvferry.operator.runtime import finalizers, peering, selfmetrics, shard
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import GROUP, PLURAL, VERSION, Inference, names
from kvferry.operator.status import publish, scrape

CR = (GROUP, VERSION, PLURAL)
log = logging.getLogger("kvferry.operator")
MANAGED = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
# (group, version, plural) of managed kinds whose edits are corrected at once; others by the resync timer.
WATCHED = [
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
]


# (group, version, plural) of every kind a CR's render produces: indexed so unchanged objects are not
# re-applied.
def _gvp(kind: str) -> tuple[str, str, str]:
    """(group, version, plural) of a kind in apply.RESOURCES ("/apis/apps/v1" -> apps, v1)."""
    prefix, plural = RESOURCES[kind]
    group_version = prefix.removeprefix("/apis/").removeprefix("/api/")
    group, _, version = group_version.rpartition("/")
    return group, version, plural


ALL_RENDERED = [_gvp(kind) for kind in RENDERED_KINDS]
RETRY_DELAY_S = 10
CONFLICT_RETRY_S = 60  # a foreign object of our name goes away only when a person acts


def post(body: Any, outcome: steps.Outcome) -> None:
    for kind, reason, message in outcome.events:
        (kopf.warn if kind == "Warning" else kopf.info)(body, reason=reason.value, message=message[:1000])


def raise_for(outcome: steps.Outcome) -> None:
    """Translate errors into kopf's vocabulary: invalid spec never retries, apply failures do."""
    if outcome.invalid:
        raise kopf.PermanentError(outcome.invalid)
    if outcome.failed:
        raise kopf.TemporaryError(outcome.failed, delay=RETRY_DELAY_S)
    if outcome.conflict:
        raise kopf.TemporaryError(outcome.conflict, delay=CONFLICT_RETRY_S)


def timed(trigger: str, run: Callable[[], steps.Outcome]) -> steps.Outcome:
    """Run one reconcile, counting it by trigger and result in the operator's own metrics."""
    with selfmetrics.RECONCILE_SECONDS.time():
        outcome = run()
    kinds = (("invalid", outcome.invalid), ("failed", outcome.failed), ("conflict", outcome.conflict))
    result = next((kind for kind, what in (*kinds, ("gone", outcome.gone)) if what), "ok")
    selfmetrics.RECONCILES.labels(trigger, result).inc()
    return outcome


def owner_key(obj: Any) -> tuple[str, str] | None:
    ref = next((r for r in obj["metadata"].get("ownerReferences", []) if r.get("controller")), None)
    if not ref or ref.get("kind") != "DisaggregatedInference":
        return None
    return obj["metadata"]["namespace"], ref["name"]


def _first(index: Any, key: Any) -> Any:
    try:
        store = index.get(key) if index is not None else None
        return next(iter(store), None) if store else None
    except RuntimeError:  # changed by the watch while this thread read it: take it as not seen
        return None


def cr_of(inferences: Any, key: Any) -> dict[str, Any] | None:
    """The CR as the `inferences` index last saw it (a fresh parse: the caller may keep or change it)."""
    return unpack(_first(inferences, key)) if key else None


def watched_copy(body: Any) -> dict[str, Any]:
    """What the status, drift and autoscale code reads of a watched StatefulSet/Deployment, and no more.

    Readers: status.conditions (role_status, role_problem, router_problem, summarize: the whole status,
    metadata.generation, spec.template.metadata.labels), publish.desired_replicas (spec.replicas),
    publish.newer/_versions and the autoscaler (metadata.resourceVersion, spec.replicas,
    status.readyReplicas), the ownership gate (metadata.uid, ownerReferences: apply.not_controlled).
    A whole StatefulSet is ~16 KiB parsed; this is ~1.
    """
    meta, spec = body["metadata"], body.get("spec") or {}
    keep_meta = ("name", "namespace", "uid", "resourceVersion", "generation", "labels", "ownerReferences")
    out: dict[str, Any] = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {k: meta[k] for k in keep_meta if k in meta},
        "spec": {k: spec[k] for k in ("replicas",) if k in spec},
    }
    template = spec.get("template")
    if template is not None:
        out["spec"]["template"] = {}
        if "metadata" in template:
            tmeta = template["metadata"] or {}
            out["spec"]["template"]["metadata"] = {k: tmeta[k] for k in ("labels",) if k in tmeta}
    if "status" in body:
        out["status"] = body["status"]
    plain: dict[str, Any] = json.loads(json.dumps(out))  # plain dicts of its own, nothing shared with kopf's
    return plain


def watched_by(owned: Any, cr: Any) -> publish.Watched:
    """The CR's workloads as the watch last saw them, looked up when asked (a reconcile runs long)."""
    ns, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    return lambda role: _first(owned, (ns, name, role))


def stored_by(copies: Any, cr: Any) -> steps.Stored:
    """The CR's objects as the watch last saw them ((kind, name) -> copy), None where not indexed."""
    ns, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    if copies is None:
        return steps.nothing_stored

    def stored(kind: str, obj_name: str) -> dict[str, Any] | None:
        return unpack(_first(copies, (ns, name, kind, obj_name)))

    return stored


def shard_finalizer(index: int, count: int) -> str:
    """kopf's finalizer on this replica's CRs. kopf removes its finalizer from every object for which no
    handler needs it, so replicas of different shards must not share one name (finalizers.py knows both)."""
    base = f"{names.GROUP}/finalizer"
    return base if count == 1 else f"{base}-shard-{index}-of-{count}"


class ShardDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's last-handled configuration, written only on this replica's CRs.

    kopf stores it on every object it sees once no handler is left to run, matching or not: a replica of
    another shard would mark a CR as created before its owner saw it, and its create handler never ran.
    """

    def __init__(self, index: int, count: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._index, self._count = index, count

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        meta = body.get("metadata") or {}
        if shard.owns(meta.get("namespace", ""), meta.get("name", ""), self._index, self._count):
            super().store(body=body, patch=patch, essence=essence)


def _stripped(body: Any) -> dict[str, Any]:
    """A watched object without what a reconcile never reads (managedFields are most of its size)."""
    workload = body.get("kind") in ("StatefulSet", "Deployment")
    obj = {k: v for k, v in dict(body).items() if k != "status" or workload}
    obj["metadata"] = {k: v for k, v in dict(body["metadata"]).items() if k != "managedFields"}
    return obj


def _warnings_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def quiet_kopf_events() -> None:
    """Post only kopf's own warnings and errors as Kubernetes events, not its INFO lines.

    kopf posts its object log lines as events; "Timer 'transfer-status' succeeded." every metrics
    interval per CR is ~33 event writes a second at 1,000 CRs, through one posting queue. The
    operator's own events (post(): kopf.info/kopf.warn) do not go through logging and are unaffected.
    """
    for handler in logging.getLogger("kopf.objects").handlers:
        if type(handler).__name__ == "K8sPoster" and _warnings_only not in handler.filters:
            handler.addFilter(_warnings_only)


class Shard:
    """The `when=` filters: this replica's CRs (`mine`) and the objects they own (`mine_owned`)."""

    def __init__(self, index: int, count: int) -> None:
        self.index, self.count = index, count

    def mine(self, namespace: str, name: str, **_: Any) -> bool:
        return shard.owns(namespace, name, self.index, self.count)

    def mine_owned(self, body: kopf.Body, **_: Any) -> bool:
        key = owner_key(body)
        return key is not None and shard.owns(*key, self.index, self.count)


class Handlers:
    """The handlers that need the operator's configuration; each is registered by `register`."""

    def __init__(self, cfg: OperatorConfig) -> None:
        self.cfg = cfg
        self.index, self.count = cfg.shard_of

    def configure(self, settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        """Startup: kopf's persistence and execution settings, then what every handler shares in memo."""
        cfg, index, count = self.cfg, self.index, self.count
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.KOPF_PREFIX)
        settings.persistence.diffbase_storage = ShardDiffBaseStorage(index, count, prefix=names.KOPF_PREFIX)
        settings.persistence.finalizer = shard_finalizer(index, count)  # kopf's, while timers run
        # Stop a deleted CR's timers promptly (kopf re-checks every 60 s by default).
        settings.background.cancellation_polling = 2
        settings.posting.level = 20  # INFO and up become Kubernetes events
        quiet_kopf_events()
        workers = 8  # reconciles run in threads (the client is synchronous)
        settings.execution.max_workers = workers
        memo.executor = settings.execution.executor
        memo.checks = Latest(workers)  # workload checks waiting for a thread
        memo.kube = Kube.from_kubeconfig(cfg.kubeconfig or None)
        memo.kube.on_request = selfmetrics.record_request
        if cfg.peering and not cfg.standalone:  # startup runs before kopf starts peering
            peering.ensure_peering(memo.kube, cfg.peering_name, cfg.namespaces)
        if cfg.metrics_port:
            selfmetrics.serve(cfg.metrics_port, cfg.metrics_host)
        memo.fetch = scrape.http_fetcher(cfg.metrics_timeout)
        memo.nodes = network.NodeLayers()  # shared by every CR's timer (see memo.views below)
        memo.changes = Changes()
        # kopf gives each object a shallow copy of this memo: a dict set here is shared by all of them.
        memo.views = {}
        memo.refreshes = Coalescer(lambda key: refresh_status(memo, key), cfg.status_interval)

    def login(self, **_: Any) -> kopf.ConnectionInfo:
        """A private registry gets none of kopf's default login handlers; kopf must use exactly the
        credentials our own client uses (--kubeconfig, else in-cluster, else KUBECONFIG)."""
        c = load_configuration(self.cfg.kubeconfig or None)
        header = c.get_api_key_with_prefix("BearerToken") or ""
        scheme, _space, token = header.rpartition(" ")
        return kopf.ConnectionInfo(
            server=c.host,
            ca_path=c.ssl_ca_cert,
            insecure=not c.verify_ssl,
            scheme=scheme or None,
            token=token or None,
            certificate_path=c.cert_file,
            private_key_path=c.key_file,
        )

    def reconcile_cr(
        self,
        body: kopf.Body,
        memo: kopf.Memo,
        reason: kopf.Reason,
        owned: kopf.Index[Any, Any],
        **indexes: Any,
    ) -> None:
        """CR created, updated or resumed: render, apply what differs from the indexed copies, status."""
        trigger = getattr(reason, "value", str(reason))
        stored = stored_by(indexes.get("copies"), body)
        watched = watched_by(owned, body)

        def run() -> steps.Outcome:
            cr = Inference.of(_plain(body))
            return steps.reconcile(memo.kube, cr, self.cfg, trigger=trigger, watched=watched, stored=stored)

        outcome = timed(trigger, run)
        post(body, outcome)
        raise_for(outcome)

    async def owned_changed(
        self,
        event: dict[str, Any],
        body: kopf.Body,
        memo: kopf.Memo,
        inferences: kopf.Index[Any, Any],
        owned: kopf.Index[Any, Any],
        **_: Any,
    ) -> None:
        """A managed workload, Service or ConfigMap changed: nothing, one coalesced status refresh, or a
        drift check queued for a thread (the object's watch worker goes on with its next event)."""
        key = owner_key(body)
        memo.views.update(inferences=inferences, owned=owned, context=contextvars.copy_context())
        change = memo.changes.note(body, event.get("type"))
        if change is Change.NONE:
            return  # nothing we render or show moved (our own apply, an annotation, the listing)
        known = key is not None and _first(inferences, key) is not None
        if change is Change.REFRESH and known:
            memo.refreshes.request(key)  # folded with the CR's other workload events into one patch
            return
        cr = cr_of(inferences, key) if known else None
        if cr is None or event.get("type") not in ("MODIFIED", "DELETED"):
            kind, known_text = body.get("kind"), "known" if cr else "not indexed"
            log.debug("owned event %s %s: owner %s %s", event.get("type"), kind, key, known_text)
            return
        if cr["metadata"].get("deletionTimestamp"):
            return  # the GC is removing everything; re-applying would fight it
        # The newest waiting check wins.
        memo.checks.submit(
            body["metadata"]["uid"], self._drift_check(memo, cr, key, event["type"], body, owned)
        )

    def _drift_check(
        self, memo: kopf.Memo, cr: dict[str, Any], key: Any, event_type: str, body: kopf.Body, owned: Any
    ) -> Callable[[], Awaitable[None]]:
        """The check `owned_changed` queues: re-apply on drift or deletion, on one of kopf's threads."""
        parsed, obj, watched = Inference.of(cr), _plain(body), watched_by(owned, cr)

        def run() -> steps.Outcome:
            def change() -> steps.Outcome:
                return steps.on_owned_change(
                    memo.kube,
                    parsed,
                    self.cfg,
                    event_type=event_type,
                    obj=obj,
                    watched=watched,
                    refresh=lambda: memo.refreshes.request(key),
                )

            return timed("owned", change)

        async def check() -> None:
            # Render and apply block on the API server: on kopf's threads, with kopf's context (posting).
            ctx = contextvars.copy_context()
            outcome = await asyncio.get_running_loop().run_in_executor(memo.executor, ctx.run, run)
            post(_ref(cr), outcome)

        return check

    def transfer_status(
        self, body: kopf.Body, memo: kopf.Memo, owned: kopf.Index[Any, Any], **_: Any
    ) -> None:
        """Metrics timer: the engines' transfer metrics into status.transfer and TransferHealthy."""
        cr = Inference.of(_plain(body))
        events = scrape.scrape(memo.kube, cr, self.cfg, memo.fetch, watched_by(owned, body), memo.nodes)
        post(body, steps.Outcome(events=events))

    def resync(self, body: kopf.Body, memo: kopf.Memo, owned: kopf.Index[Any, Any], **_: Any) -> None:
        """Slow timer: a full reconcile, for drift the watches missed."""
        watched = watched_by(owned, body)

        def run() -> steps.Outcome:
            cr = Inference.of(_plain(body))
            return steps.reconcile(memo.kube, cr, self.cfg, trigger="resync", watched=watched)

        post(body, timed("resync", run))

    async def stale_finalizers(self, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        """A CR being deleted may carry another shard layout's finalizer, which no replica removes."""
        cr, current = _plain(body), shard_finalizer(self.index, self.count)
        if not finalizers.stale(cr, current):  # pure: nothing is read or written for every other event
            return
        loop = asyncio.get_running_loop()
        gone = await loop.run_in_executor(memo.executor, finalizers.release_stale, memo.kube, cr, current)
        if gone:
            meta = cr["metadata"]
            log.info(
                "removed stale finalizers %s of %s/%s", gone, meta["namespace"], body["metadata"]["name"]
            )


def refresh_status(memo: kopf.Memo, key: Any) -> None:
    """One coalesced status refresh of the CR `key` (Coalescer's callback, on its own thread)."""
    # kopf hands indexes to handlers only: the workload handlers leave them in memo.views.
    inferences, owned = memo.views["inferences"], memo.views["owned"]
    cr = cr_of(inferences, key)
    if cr is None or cr["metadata"].get("deletionTimestamp"):
        return  # deleted meanwhile
    watched = watched_by(owned, cr)
    outcome = timed("owned", lambda: steps.refresh_status(memo.kube, Inference.of(cr), watched))
    # kopf's event posting reads its settings from a context variable its own threads carry:
    # post from a copy of a handler thread's context (one per run: a context is not shareable).
    memo.views["context"].copy().run(post, _ref(cr), outcome)


def close(memo: kopf.Memo, **_: Any) -> None:
    """Cleanup: stop the refresh batcher and close the API client."""
    memo.refreshes.close()
    memo.kube.close()


# Indexes and the workload-event sorter are async on purpose: kopf runs sync handlers on its 8 threads,
# where they would queue behind reconciles waiting on the API server, and every object's pending
# watch events (full bodies) would pile up meanwhile (most of 1.1 GiB at 1,000 CRs).
async def index_inference(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict[Any, Any]:
    """The `inferences` index: each CR, packed, without managedFields."""
    cr = _plain(body)
    cr["metadata"].pop("managedFields", None)  # never read; most of a CR's size after a few writes
    return {(namespace, name): pack(cr)}


async def index_workload(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """The `owned` index: each CR's workloads by role, trimmed to what status reads."""
    key = owner_key(body)
    role = body["metadata"].get("labels", {}).get(names.LABEL_ROLE)
    return {(*key, role): watched_copy(body)} if key else {}


async def index_copy(body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """The `copies` index: every managed object, packed, so a reconcile writes only what differs."""
    key = owner_key(body)
    packed = pack(_stripped(body))
    return {(*key, body["kind"], body["metadata"]["name"]): packed} if key else {}


def _kopf(fn: Callable[..., Any]) -> Any:
    """`fn` as kopf's decorators take it. kopf's callback protocols list every keyword kopf passes; a
    handler here names only what it reads (and the indexes kopf passes by name), which those protocols
    cannot express."""
    return fn


def register(registry: kopf.OperatorRegistry, cfg: OperatorConfig) -> None:
    """Attach every handler to `registry`, with intervals taken from `cfg`: the table of contents."""
    h, s = Handlers(cfg), Shard(*cfg.shard_of)
    mine, mine_owned = _kopf(s.mine), _kopf(s.mine_owned)
    kopf.on.startup(registry=registry)(_kopf(h.configure))
    kopf.on.login(registry=registry)(_kopf(h.login))
    kopf.on.cleanup(registry=registry)(_kopf(close))
    kopf.index(*CR, id="inferences", when=mine, registry=registry)(_kopf(index_inference))
    for plural in ("deployments", "statefulsets"):
        kopf.index("apps", "v1", plural, labels=MANAGED, id="owned", when=mine_owned, registry=registry)(
            _kopf(index_workload)
        )
    for group, version, plural in ALL_RENDERED:
        kopf.index(group, version, plural, labels=MANAGED, id="copies", when=mine_owned, registry=registry)(
            _kopf(index_copy)
        )
    for on in (kopf.on.update, kopf.on.create, kopf.on.resume):
        on(*CR, id="reconcile", when=mine, registry=registry)(_kopf(h.reconcile_cr))
    for group, version, plural in WATCHED:
        kopf.on.event(
            group, version, plural, labels=MANAGED, when=mine_owned, registry=registry, id=f"owned-{plural}"
        )(_kopf(h.owned_changed))
    kopf.timer(
        *CR,
        id="transfer-status",
        interval=cfg.metrics_interval,
        initial_delay=1.0,
        when=mine,
        registry=registry,
    )(_kopf(h.transfer_status))
    kopf.timer(
        *CR,
        id="resync",
        interval=cfg.resync_interval,
        initial_delay=cfg.resync_interval,
        when=mine,
        registry=registry,
    )(_kopf(h.resync))
    kopf.on.event(*CR, id="stale-finalizers", when=mine, registry=registry)(_kopf(h.stale_finalizers))
    # spec.autoscaling: a planner evaluation per autoscaled CR each metrics interval (operator/autoscale/)
    autoscale_timer.register(registry, cfg, plain=_plain, watched_by=watched_by, when=mine)


def _plain(body: Any) -> dict[str, Any]:
    """A kopf Body as plain dicts (the render and reconcile steps take JSON-shaped data)."""
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": dict(body["metadata"]),
        "spec": dict(body.get("spec") or {}),
        "status": dict(body.get("status") or {}),
    }


def _ref(cr: dict[str, Any]) -> dict[str, Any]:
    """Enough of a CR for kopf to post an event about it."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggregatedInference", "metadata": cr["metadata"]}
