"""Reconcile step: render -> apply -> summarize -> one status patch, for one DisaggregatedInference.

Plain functions over the `Kube` client; no kopf here. They return an `Outcome` (events to post, the
status written, an error kind) and the handlers translate it into kopf events and retry errors.
Level-based: every entry point recomputes from the CR and what exists, so running one twice is harmless.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvferry.operator import names, secrets, status
from kvferry.operator.apply import Kube, KubeError, now_iso
from kvferry.operator.config import OperatorConfig
from kvferry.operator.drift import drifted
from kvferry.operator.render import render
from kvferry.operator.spec import SpecError
from kvferry.operator.status import ConditionType, EventReason, Observed

log = logging.getLogger("kvferry.operator")
Event = tuple[str, EventReason, str]  # (Normal|Warning, reason, message)
# role ("prefill"/"decode"/"router") -> the operator's last watched copy of that workload, or None.
Watched = Callable[[str], dict[str, Any] | None]
REOBSERVE_ROUNDS = 3


def no_watch(_role: str) -> dict[str, Any] | None:
    return None


@dataclass
class Outcome:
    events: list[Event] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    invalid: str = ""  # spec error: retrying cannot help
    failed: str = ""  # apply error: retry later
    drifted: list[str] = field(default_factory=list)
    gone: str = ""  # the namespace is being deleted: nothing to do, nothing to retry


def _desired(cr: dict[str, Any], sts: dict[str, dict[str, Any] | None] | None = None) -> dict[str, int]:
    """Replicas each role should have: the spec's, or the StatefulSet's own where an autoscaler owns them."""
    spec, sts = cr.get("spec") or {}, sts or {}
    out = {}
    for role in names.ROLES:
        rspec = spec.get(role) or {}
        current = (sts.get(role) or {}).get("spec", {}).get("replicas")
        autoscaled = rspec.get("replicasOwner") == "autoscaler" and current is not None
        out[role] = int(current if autoscaled else rspec.get("replicas", 1))
    return out


def observed_replicas(kube: Kube, cr: dict[str, Any]) -> dict[str, int | None]:
    """Current replicas of roles an autoscaler owns (read back so the apply never moves them)."""
    meta, spec = cr["metadata"], cr.get("spec") or {}
    out: dict[str, int | None] = {}
    for role in names.ROLES:
        if (spec.get(role) or {}).get("replicasOwner") == "autoscaler":
            sts = kube.get("StatefulSet", meta["namespace"], names.role_name(meta["name"], role))
            out[role] = sts["spec"].get("replicas") if sts else None
    return out


STATUS_ATTEMPTS = 4


def write_status(
    kube: Kube, cr: dict[str, Any], compute: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """Patch status with `compute(previous_status)`, only if it changes anything, optimistically.

    The patch carries the CR's resourceVersion; on a conflict (the other status writer got there first)
    the CR is read again and the patch recomputed from what is there now, so neither writer clobbers
    the other's conditions with a stale copy. Returns the patch written (or that needed no write).
    """
    meta = cr["metadata"]
    for _ in range(STATUS_ATTEMPTS):
        previous = cr.get("status") or {}
        patch = compute(previous)
        if all(previous.get(k) == v for k, v in patch.items()):
            return patch
        try:
            kube.patch_status(meta["namespace"], meta["name"], patch, cr["metadata"].get("resourceVersion"))
            return patch
        except KubeError as exc:
            if exc.status != 409:
                raise
        fresh = kube.get("DisaggregatedInference", meta["namespace"], meta["name"])
        if fresh is None:
            return patch  # deleted meanwhile
        cr = fresh
    raise KubeError(409, f"status of {meta['namespace']}/{meta['name']} kept changing under us")


def newer(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The later of two copies of one object: `b` only if its resourceVersion is provably higher.

    Within one API server resourceVersions are etcd revisions (integers that only grow; comparable
    by contract since Kubernetes 1.35's ComparableResourceVersion); anything else keeps `a`.
    """
    if a is None or b is None:
        return a if b is None else b
    ra, rb = (str(o["metadata"].get("resourceVersion", "")) for o in (a, b))
    return b if ra.isdigit() and rb.isdigit() and int(rb) > int(ra) else a


def freshest(observed: Observed, watched: Watched) -> Observed:
    """`observed` with each workload replaced by the watch's copy where that one is newer."""
    return replace(
        observed,
        statefulsets={r: newer(observed.statefulsets.get(r), watched(r)) for r in names.ROLES},
        router=newer(observed.router, watched("router")),
    )


def _versions(observed: Observed) -> list[str | None]:
    objs = [*(observed.statefulsets.get(r) for r in names.ROLES), observed.router]
    return [o["metadata"].get("resourceVersion") if o else None for o in objs]


def write_observed_status(
    kube: Kube,
    cr: dict[str, Any],
    observed: Observed,
    watched: Watched,
    summarize: Callable[[dict[str, Any], Observed], dict[str, Any]],
) -> dict[str, Any]:
    """write_status from the newest workloads known, again if the watch moved on while writing.

    Two writers summarize workloads into status: a reconcile (from its apply responses) and the
    refresh on each workload event. Without this a reconcile that started before a pod became ready
    could write last and leave "0/1 ready" until the next resync: the refresh of that event may have
    run before the reconcile's write, or skipped because the CR had no status yet. The watch updates
    its copies before it runs handlers, so re-checking them after the write closes that window.
    """
    used: list[Observed] = []

    def compute(prev: dict[str, Any]) -> dict[str, Any]:
        used.append(freshest(observed, watched))
        return summarize(prev, used[-1])

    meta = cr["metadata"]
    patch = write_status(kube, cr, compute)
    for _ in range(REOBSERVE_ROUNDS):
        if _versions(freshest(observed, watched)) == _versions(used[-1]):
            break
        fresh = kube.get("DisaggregatedInference", meta["namespace"], meta["name"])
        if fresh is None:
            break
        patch = write_status(kube, fresh, compute)
    return patch


def _without_transfer(status_: dict[str, Any]) -> dict[str, Any]:
    """The reconcile's part of status: everything but the transfer summary (the metrics timer's)."""
    return {k: v for k, v in status_.items() if k != "transfer"}


def flip_events(previous: dict[str, Any], new: dict[str, Any]) -> list[Event]:
    events: list[Event] = []
    old_ready, new_ready = (
        status.condition(previous, ConditionType.READY),
        status.condition(new, ConditionType.READY),
    )
    if new_ready and (old_ready or {}).get("status") != new_ready["status"]:
        if new_ready["status"] == "True":
            events.append(("Normal", EventReason.READY, new_ready["message"]))
        elif old_ready:
            events.append(
                ("Warning", EventReason.NOT_READY, f"{new_ready['reason']}: {new_ready['message']}")
            )
    if previous.get("revision") and previous["revision"] != new.get("revision"):
        events.append(
            (
                "Normal",
                EventReason.ROLLOUT_STARTED,
                f"revision {previous['revision']} -> {new['revision']}: rolling prefill and decode",
            )
        )
    return events


def reconcile(
    kube: Kube, cr: dict[str, Any], cfg: OperatorConfig, *, trigger: str, watched: Watched = no_watch
) -> Outcome:
    """Bring the cluster to what `cr` asks for, then write its status."""
    meta = cr["metadata"]
    ns, name, generation = meta["namespace"], meta["name"], meta.get("generation", 0)
    previous = cr.get("status") or {}
    out = Outcome()
    summarize_kw = dict(
        cr_name=name,
        namespace=ns,
        generation=generation,
        router_replicas=int(((cr.get("spec") or {}).get("router") or {}).get("replicas", 1)),
        now=now_iso(),
    )

    # Step 1: render (pure). A spec the API server let through but render rejects is a permanent error.
    try:
        rendered = render(cr, router_image=cfg.router_image, observed_replicas=observed_replicas(kube, cr))
    except SpecError as exc:
        out.invalid = str(exc)
        out.status = write_status(
            kube,
            cr,
            lambda prev: _without_transfer(
                status.summarize(
                    Observed(spec_error=out.invalid),
                    revision=prev.get("revision", ""),
                    desired=_desired(cr),
                    previous=prev,
                    **summarize_kw,
                )
            ),
        )
        out.events.append(("Warning", EventReason.INVALID_SPEC, out.invalid))
        return out

    # Step 1b: referenced Secrets must exist (metadata only). Still apply: pods start once it appears.
    try:
        secret_error = secrets.missing_secrets(kube, ns, rendered.spec)
    except KubeError as exc:
        secret_error = f"cannot check referenced secrets: {exc}"
    if secret_error:
        out.events.append(("Warning", EventReason.SECRET_MISSING, secret_error))

    # Step 2: server-side apply every object; keep going past failures so one bad object blocks nothing.
    applied: dict[tuple[str, str], dict[str, Any]] = {}
    errors = []
    for obj in rendered.objects:
        try:
            applied[(obj["kind"], obj["metadata"]["name"])] = kube.apply(obj)
        except KubeError as exc:
            if exc.namespace_terminating:
                log.info("namespace %s is being deleted: not reconciling %s", ns, name)
                return Outcome(gone=f"namespace {ns} is being deleted")
            errors.append(str(exc))
        if cfg.apply_pause_seconds:
            time.sleep(cfg.apply_pause_seconds)
    out.failed = "; ".join(errors)
    if out.failed:
        out.events.append(("Warning", EventReason.APPLY_FAILED, out.failed))
    elif trigger in ("create", "update"):
        out.events.append(
            ("Normal", EventReason.APPLIED, f"applied {len(applied)} objects, revision {rendered.revision}")
        )

    # Step 3: summarize from the objects the apply returned (they carry current status: no extra reads).
    observed = Observed(
        statefulsets={r: applied.get(("StatefulSet", names.role_name(name, r))) for r in names.ROLES},
        router=applied.get(("Deployment", names.router_name(name))),
        apply_error=out.failed,
        secret_error=secret_error,
    )

    # Step 4: one status patch, written even when the apply failed; a newer watched copy wins.
    def compute(prev: dict[str, Any], seen: Observed) -> dict[str, Any]:
        desired = _desired(cr, seen.statefulsets)
        new = status.summarize(
            seen, revision=rendered.revision, desired=desired, previous=prev, **summarize_kw
        )
        return _without_transfer(new)

    out.status = write_observed_status(kube, cr, observed, watched, compute)
    out.events += flip_events(previous, out.status)
    return out


def on_owned_change(
    kube: Kube,
    cr: dict[str, Any],
    cfg: OperatorConfig,
    *,
    event_type: str,
    obj: dict[str, Any],
    watched: Watched,
) -> Outcome:
    """A managed object changed: re-apply if it was deleted or edited, else just refresh status.

    watched: the CR's StatefulSets ("prefill"/"decode") and router Deployment ("router") as last watched.
    """
    kind, obj_name = obj["kind"], obj["metadata"]["name"]
    try:
        desired = {
            (o["kind"], o["metadata"]["name"]): o for o in render(cr, router_image=cfg.router_image).objects
        }
    except SpecError:
        return Outcome()  # the CR's own handler reports invalid specs
    mine = desired.get((kind, obj_name))
    if mine is None:
        return Outcome()
    sts_role = obj["metadata"].get("labels", {}).get(names.LABEL_ROLE)
    autoscaled = ((cr.get("spec") or {}).get(sts_role) or {}).get("replicasOwner") == "autoscaler"
    if autoscaled:
        mine.get("spec", {}).pop("replicas", None)
    if event_type == "DELETED" or drifted(mine, obj):
        out = reconcile(kube, cr, cfg, trigger="drift", watched=watched)
        verb = "deleted" if event_type == "DELETED" else "edited outside the operator"
        out.drifted.append(f"{kind} {obj_name}")
        out.events.append(
            ("Normal", EventReason.DRIFT_CORRECTED, f"{kind} {obj_name} was {verb}; re-applied")
        )
        return out
    return refresh_status(kube, cr, watched)


def refresh_status(kube: Kube, cr: dict[str, Any], watched: Watched) -> Outcome:
    """Status from the watched StatefulSets/Deployment, without touching the objects."""
    meta = cr["metadata"]
    previous = cr.get("status") or {}
    if not previous.get("revision"):
        # The indexed copy may predate the first reconcile's status patch (a busy operator sees the
        # pod/Deployment event first): read the CR once instead of dropping this last change.
        fresh = kube.get("DisaggregatedInference", meta["namespace"], meta["name"])
        if fresh is None or not (fresh.get("status") or {}).get("revision"):
            log.debug("status refresh of %s skipped: not reconciled yet", meta["name"])
            return Outcome()  # not reconciled yet: the CR handler writes the first status
        cr, previous = fresh, fresh["status"]

    def compute(prev: dict[str, Any], seen: Observed) -> dict[str, Any]:
        new = status.summarize(
            seen,
            cr_name=meta["name"],
            namespace=meta["namespace"],
            generation=prev.get("observedGeneration", 0),
            revision=prev.get("revision", previous["revision"]),
            desired=_desired(cr, seen.statefulsets),
            router_replicas=int(((cr.get("spec") or {}).get("router") or {}).get("replicas", 1)),
            previous=prev,
            now=now_iso(),
        )
        return _without_transfer(new)

    new = write_observed_status(kube, cr, Observed(), watched, compute)
    log.debug("status refresh of %s: %s", meta["name"], status.condition(new, ConditionType.READY))
    return Outcome(status=new, events=flip_events(previous, new))
