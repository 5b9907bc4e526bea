"""Reconcile step: render -> apply -> summarize -> one status patch, for one DisaggregatedInference.

Plain functions over the `Kube` client and the CR as its handler parsed it (spec.Inference); no kopf
here. They return an `Outcome` (events to post, the status written, an error kind) and the handlers
translate it into kopf events and retry errors.
Level-based: every entry point recomputes from the CR and what exists, so running one twice is harmless.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvferry.operator.reconcile import secrets, token
from kvferry.operator.reconcile.apply import Kube, KubeError, NotControlled, not_ours
from kvferry.operator.reconcile.drift import drifted, up_to_date
from kvferry.operator.render.objects import render
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import Inference, SpecError, names
from kvferry.operator.status import conditions as status
from kvferry.operator.status import gang as gang_status
from kvferry.operator.status.conditions import ConditionType, EventReason, Observed, Reason
from kvferry.operator.status.publish import Watched, no_watch, publish

log = logging.getLogger("kvferry.operator")
Event = tuple[str, EventReason, str]  # (Normal|Warning, reason, message)
# (kind, name) -> the watch's copy of that object of this CR, or None (not seen, or not watched).
Stored = Callable[[str, str], dict[str, Any] | None]
# Triggers that apply every object whatever the watch holds: a drift correction re-applies what was
# edited. (The resync compares with the watch's copies: every rendered kind is watched, so an edit of
# a kind without an event handler, a PDB or a Role, shows in its copy and is re-applied then.)
APPLY_ALL = ("drift",)
ENGINE_WORKLOADS = ("StatefulSet", "LeaderWorkerSet")  # the kinds whose pods mount the transfer token


def nothing_stored(_kind: str, _name: str) -> dict[str, Any] | None:
    return None


@dataclass
class Outcome:
    events: list[Event] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    invalid: str = ""  # spec error: retrying cannot help
    failed: str = ""  # apply error: retry later
    conflict: str = ""  # objects of our names that another owner controls: left alone, retried slowly
    drifted: list[str] = field(default_factory=list)
    gone: str = ""  # the namespace is being deleted: nothing to do, nothing to retry
    skipped: int = 0  # objects whose watched copy already held the render: no request made


def observed_replicas(kube: Kube, cr: Inference, stored: Stored = nothing_stored) -> dict[str, int | None]:
    """Current replicas of roles an autoscaler owns (read back so the apply never moves them)."""
    out: dict[str, int | None] = {}
    if not cr.valid:
        return out  # render reports the spec
    for role in names.ROLES:
        if getattr(cr.spec, role).replicas_owner == "autoscaler":
            sts_name = names.role_name(cr.meta.name, role)
            sts = stored("StatefulSet", sts_name) or kube.get("StatefulSet", cr.meta.namespace, sts_name)
            out[role] = sts["spec"].get("replicas") if sts else None
    return out


def apply_all(
    kube: Kube, objects: list[dict[str, Any]], stored: Stored, cfg: OperatorConfig, out: Outcome
) -> tuple[dict[tuple[str, str], dict[str, Any]], list[str], list[str]]:
    """Apply what differs from the watch's copy; returns (objects as stored, errors, conflicts).

    An object whose watched copy is this CR's and already holds every rendered field is not written
    (its copy stands for the apply's answer); one the watch has never seen is created in one request.
    Raises KubeError only for a namespace being deleted.
    """
    applied: dict[tuple[str, str], dict[str, Any]] = {}
    errors, conflicts = [], []
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        copy = stored(*key)
        if copy is not None and not_ours(copy, obj) is None and up_to_date(obj, copy):
            applied[key], out.skipped = copy, out.skipped + 1
            continue
        try:
            absent = copy is None and stored is not nothing_stored
            applied[key] = kube.apply(obj, absent=True) if absent else kube.apply(obj)
        except NotControlled as exc:
            conflicts.append(str(exc))
        except KubeError as exc:
            if exc.namespace_terminating:
                raise
            errors.append(str(exc))
        if cfg.apply_pause_seconds:
            time.sleep(cfg.apply_pause_seconds)
    return applied, errors, conflicts


def _workload(applied: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any] | None:
    """A role's workload as applied: its StatefulSet, or its LeaderWorkerSet when it spans nodes (whose
    status counts groups in the same replicas/readyReplicas/updatedReplicas fields)."""
    return applied.get(("StatefulSet", name)) or applied.get(("LeaderWorkerSet", name))


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
    kube: Kube,
    cr: Inference,
    cfg: OperatorConfig,
    *,
    trigger: str,
    watched: Watched = no_watch,
    stored: Stored = nothing_stored,
) -> Outcome:
    """Bring the cluster to what `cr` asks for, then write its status.

    stored: the watch's copies of this CR's objects; objects they show up to date are not re-applied
    (except on the triggers in APPLY_ALL).
    """
    if trigger in APPLY_ALL:
        stored = nothing_stored
    ns, name, generation = cr.meta.namespace, cr.meta.name, cr.meta.generation
    previous = cr.status
    out = Outcome()
    # Step 1: render (pure). A spec the API server let through but render rejects is a permanent error.
    try:
        rendered = render(
            cr,
            registry=cfg.image_registry,
            router_image=cfg.router_image,
            observed_replicas=observed_replicas(kube, cr, stored),
            operator_namespace=cfg.operator_namespace,
        )
    except SpecError as exc:
        out.invalid = str(exc)
        invalid = Observed(faults={Reason.INVALID_SPEC: out.invalid})
        out.status = publish(kube, cr, invalid, watched, generation=generation)
        out.events.append(("Warning", EventReason.INVALID_SPEC, out.invalid))
        return out

    # Step 1b: referenced Secrets must exist (metadata only). Still apply: pods start once it appears.
    try:
        secret_error = secrets.missing_secrets(kube, ns, rendered.spec)
    except KubeError as exc:
        secret_error = f"cannot check referenced secrets: {exc}"
    if secret_error:
        out.events.append(("Warning", EventReason.SECRET_MISSING, secret_error))

    # Step 1c: the CR's transfer token Secret, created once if absent (random, so never rendered).
    # Someone else's Secret of its name is a Conflict: the engines would mount a token we never chose.
    token_errors, token_conflicts = [], []
    if rendered.spec.kv_transfer.connector == "kvferry":
        try:
            token.ensure(kube, cr)
        except NotControlled as exc:
            token_conflicts.append(
                f"{exc}: the engines would mount it as this CR's transfer token; delete or rename it, "
                "or rename the DisaggregatedInference"
            )
        except KubeError as exc:
            if exc.namespace_terminating:
                return Outcome(gone=f"namespace {ns} is being deleted")
            token_errors.append(f"transfer token Secret: {exc}")

    # Step 2: server-side apply every object we control; keep going past failures so one bad object
    # blocks nothing. An object of a rendered name that this CR does not control is left untouched:
    # apply writes only over what it has just read as this CR's, on that read's resourceVersion.
    try:
        objects = rendered.objects
        if token_conflicts:  # no engine pods that would mount a token someone else chose
            objects = [o for o in objects if o["kind"] not in ENGINE_WORKLOADS]
        applied, errors, conflicts = apply_all(kube, objects, stored, cfg, out)
    except KubeError:  # only a namespace being deleted gets here
        log.info("namespace %s is being deleted: not reconciling %s", ns, name)
        return Outcome(gone=f"namespace {ns} is being deleted")
    out.failed, out.conflict = "; ".join(token_errors + errors), "; ".join(token_conflicts + conflicts)
    if out.conflict:
        out.events.append(("Warning", EventReason.CONFLICT, out.conflict))
    if out.failed:
        out.events.append(("Warning", EventReason.APPLY_FAILED, out.failed))
    elif trigger in ("create", "update") and not out.conflict:
        out.events.append(
            ("Normal", EventReason.APPLIED, f"applied {len(applied)} objects, revision {rendered.revision}")
        )

    # Step 2b: are P and D admitted together? (GangAdmitted; discovery answers are cached by Kube.)
    gang = gang_status.observe(kube, rendered.spec, ns, name)

    # Step 3: summarize from the objects the apply returned (they carry current status: no extra reads).
    faults = {
        Reason.APPLY_FAILED: out.failed,
        Reason.CONFLICT: out.conflict,
        Reason.SECRET_MISSING: secret_error,
    }
    observed = Observed(
        statefulsets={r: _workload(applied, names.role_name(name, r)) for r in names.ROLES},
        router=applied.get(("Deployment", names.router_name(name))),
        faults={reason: message for reason, message in faults.items() if message},
        gang=gang,
    )

    # Step 4: one status patch, written even when the apply failed; a newer watched copy wins.
    # status.revision says the CR's objects are at that revision: not after a Conflict, where some of
    # them are someone else's (the autoscaler and the metrics timer wait for a revision).
    revision = None if out.conflict else rendered.revision
    out.status = publish(kube, cr, observed, watched, generation=generation, revision=revision)
    out.events += flip_events(previous, out.status)
    return out


def on_owned_change(
    kube: Kube,
    cr: Inference,
    cfg: OperatorConfig,
    *,
    event_type: str,
    obj: dict[str, Any],
    watched: Watched,
    refresh: Callable[[], None] | None = None,
) -> Outcome:
    """A managed object changed: re-apply if it was deleted or edited, else just refresh status.

    watched: the CR's StatefulSets ("prefill"/"decode") and router Deployment ("router") as last watched.
    refresh: asks for a (batched) status refresh instead of writing one now.
    """
    kind, obj_name = obj["kind"], obj["metadata"]["name"]
    try:
        desired = {
            (o["kind"], o["metadata"]["name"]): o
            for o in render(
                cr,
                registry=cfg.image_registry,
                router_image=cfg.router_image,
                operator_namespace=cfg.operator_namespace,
            ).objects
        }
    except SpecError:
        return Outcome()  # the CR's own handler reports invalid specs
    mine = desired.get((kind, obj_name))
    if mine is None:
        return Outcome()
    sts_role = obj["metadata"].get("labels", {}).get(names.LABEL_ROLE)
    if sts_role in names.ROLES and getattr(cr.spec, sts_role).replicas_owner == "autoscaler":
        mine.get("spec", {}).pop("replicas", None)
    if event_type == "DELETED" or drifted(mine, obj):
        out = reconcile(kube, cr, cfg, trigger="drift", watched=watched)
        verb = "deleted" if event_type == "DELETED" else "edited outside the operator"
        out.drifted.append(f"{kind} {obj_name}")
        out.events.append(
            ("Normal", EventReason.DRIFT_CORRECTED, f"{kind} {obj_name} was {verb}; re-applied")
        )
        return out
    if refresh is not None:
        refresh()
        return Outcome()
    return refresh_status(kube, cr, watched)


def refresh_status(kube: Kube, cr: Inference, watched: Watched) -> Outcome:
    """Status from the watched StatefulSets/Deployment, without touching the objects."""
    meta = cr.meta
    if not cr.revision:
        # The indexed copy may predate the first reconcile's status patch (a busy operator sees the
        # pod/Deployment event first): read the CR once instead of dropping this last change.
        fresh = kube.get("DisaggregatedInference", meta.namespace, meta.name)
        if fresh is None or not (fresh.get("status") or {}).get("revision"):
            log.debug("status refresh of %s skipped: not reconciled yet", meta.name)
            return Outcome()  # not reconciled yet: the CR handler writes the first status
        cr = Inference.of(fresh)
    previous = cr.status

    new = publish(kube, cr, Observed(), watched)
    log.debug("status refresh of %s: %s", meta.name, status.condition(new, ConditionType.READY))
    return Outcome(status=new, events=flip_events(previous, new))
