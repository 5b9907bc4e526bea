"""Status step: observed StatefulSets/Deployment -> the CR's status and conditions (pure, no API access).

`summarize` builds the whole status from what the apply step read back; `set_condition` keeps
lastTransitionTime still unless a condition flips, so GitOps tools and `kubectl wait` see real changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvferry.operator import names


class ConditionType(str, Enum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    TRANSFER_HEALTHY = "TransferHealthy"
    DEGRADED = "Degraded"


class Reason(str, Enum):
    ALL_READY = "AllReplicasReady"
    ROLLING_OUT = "RollingOut"
    SCALING = "Scaling"
    PODS_NOT_READY = "PodsNotReady"
    ROUTER_NOT_READY = "RouterNotReady"
    OBJECTS_MISSING = "ObjectsMissing"
    RECONCILED = "Reconciled"
    INVALID_SPEC = "InvalidSpec"
    APPLY_FAILED = "ApplyFailed"
    TRANSFER_UNHEALTHY = "TransferUnhealthy"
    SECRET_MISSING = "SecretMissing"  # Degraded: a Secret the spec references does not exist
    # TransferHealthy reasons (set by the metrics timer, see transfer_metrics.py)
    TRANSFERS_OK = "TransfersSucceeding"
    NO_TRAFFIC = "NoTransfersYet"
    TRANSFER_FAILURES = "TransferFailures"
    LAYOUT_MISMATCH = "KVLayoutMismatch"  # transfers refused: P's and D's KV layouts cannot be mapped
    WRONG_BACKEND = "UCXOnEFA"
    DECODE_RECOMPUTES = "DecodeRecomputes"
    METRICS_UNAVAILABLE = "MetricsUnavailable"
    # TransferHealthy from engine pods' termination messages (podchecks.py)
    PREFLIGHT_FAILED = "PreflightFailed"
    INJECT_FAILED = "ConnectorInjectFailed"


class EventReason(str, Enum):
    APPLIED = "Applied"
    APPLY_FAILED = "ApplyFailed"
    INVALID_SPEC = "InvalidSpec"
    ROLLOUT_STARTED = "RolloutStarted"
    READY = "Ready"
    NOT_READY = "NotReady"
    DRIFT_CORRECTED = "DriftCorrected"
    TRANSFER_HEALTH = "TransferHealthChanged"
    SECRET_MISSING = "SecretMissing"


@dataclass
class Observed:
    """What exists in the cluster for one CR (objects as the API returned them, None if absent)."""

    statefulsets: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    router: dict[str, Any] | None = None
    apply_error: str = ""
    spec_error: str = ""
    # Names each referenced Secret that does not exist; None = not checked (a status refresh keeps
    # what the last reconcile found, so the condition does not flap between reconciles).
    secret_error: str | None = None


def set_condition(
    conditions: list[dict[str, Any]],
    ctype: ConditionType,
    status: str,
    reason: Reason,
    message: str,
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """Return conditions with `ctype` set; lastTransitionTime moves only when status flips."""
    previous = next((c for c in conditions if c.get("type") == ctype.value), None)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == status else now
    new = {
        "type": ctype.value,
        "status": status,
        "reason": reason.value,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }
    return [c for c in conditions if c.get("type") != ctype.value] + [new]


def role_status(sts: dict[str, Any] | None, desired: int, cr_name: str, role: str) -> dict[str, Any]:
    st = (sts or {}).get("status", {})
    ready = st.get("readyReplicas", 0)
    selector = ",".join(f"{k}={v}" for k, v in names.selector_labels(cr_name, role).items())
    return {
        "desired": desired,
        "replicas": st.get("replicas", 0),
        "readyReplicas": ready,
        "updatedReplicas": st.get("updatedReplicas", 0),
        "summary": f"{ready}/{desired}",
        "selector": selector,
    }


def role_problem(sts: dict[str, Any] | None, desired: int, revision: str) -> tuple[Reason, str] | None:
    """Why a role is not fully current and ready, or None when it is."""
    if sts is None:
        return Reason.OBJECTS_MISSING, "StatefulSet does not exist yet"
    meta, st = sts["metadata"], sts.get("status", {})
    template_rev = sts["spec"]["template"]["metadata"].get("labels", {}).get(names.LABEL_REVISION)
    if template_rev != revision or st.get("observedGeneration", 0) < meta.get("generation", 0):
        return Reason.ROLLING_OUT, "StatefulSet controller has not seen the new template yet"
    if st.get("updateRevision") and st.get("currentRevision") != st.get("updateRevision"):
        return Reason.ROLLING_OUT, f"{st.get('updatedReplicas', 0)}/{desired} pods on the new revision"
    if st.get("updatedReplicas", 0) < desired:
        return Reason.ROLLING_OUT, f"{st.get('updatedReplicas', 0)}/{desired} pods on the new revision"
    if st.get("replicas", 0) != desired:
        return Reason.SCALING, f"{st.get('replicas', 0)} pods, want {desired}"
    if st.get("readyReplicas", 0) < desired:
        return Reason.PODS_NOT_READY, f"{st.get('readyReplicas', 0)}/{desired} pods ready"
    return None


def router_problem(dep: dict[str, Any] | None, desired: int) -> tuple[Reason, str] | None:
    if dep is None:
        return Reason.OBJECTS_MISSING, "router Deployment does not exist yet"
    st = dep.get("status", {})
    if st.get("observedGeneration", 0) < dep["metadata"].get("generation", 0):
        return Reason.ROLLING_OUT, "router Deployment not yet observed"
    if st.get("updatedReplicas", 0) < desired or st.get("readyReplicas", 0) < desired:
        return Reason.ROUTER_NOT_READY, f"{st.get('readyReplicas', 0)}/{desired} router pods ready"
    if st.get("replicas", 0) > desired:
        return Reason.ROLLING_OUT, "old router pods still terminating"
    return None


def summarize(
    observed: Observed,
    *,
    cr_name: str,
    namespace: str,
    generation: int,
    revision: str,
    desired: dict[str, int],
    router_replicas: int,
    previous: dict[str, Any],
    now: str,
) -> dict[str, Any]:
    """The full new status; the transfer summary and TransferHealthy carry over (the timer owns them)."""
    conditions = list(previous.get("conditions", []))
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "revision": revision,
        "endpoint": f"http://{names.service_name(cr_name)}.{namespace}.svc:{names.HTTP_PORT}",
        "transfer": previous.get("transfer", {}),
    }
    problems: list[tuple[str, tuple[Reason, str]]] = []
    for role in names.ROLES:
        sts = observed.statefulsets.get(role)
        status[role] = role_status(sts, desired[role], cr_name, role)
        if (problem := role_problem(sts, desired[role], revision)) is not None:
            problems.append((role, problem))
    dep = observed.router
    status["router"] = {
        "replicas": (dep or {}).get("status", {}).get("replicas", 0),
        "readyReplicas": (dep or {}).get("status", {}).get("readyReplicas", 0),
    }
    if (problem := router_problem(dep, router_replicas)) is not None:
        problems.append(("router", problem))

    failure = observed.spec_error or observed.apply_error
    set_ = lambda c, s, r, m: set_condition(conditions, c, s, r, m, generation, now)  # noqa: E731
    if failure:
        reason = Reason.INVALID_SPEC if observed.spec_error else Reason.APPLY_FAILED
        conditions = set_(ConditionType.READY, "False", reason, failure)
        conditions = set_(ConditionType.PROGRESSING, "False", reason, failure)
        conditions = set_(ConditionType.DEGRADED, "True", reason, failure)
    else:
        if problems:
            who, (reason, message) = problems[0]
            detail = "; ".join(f"{w}: {m}" for w, (_, m) in problems)
            conditions = set_(ConditionType.READY, "False", reason, detail)
            moving = any(
                r
                in (
                    Reason.ROLLING_OUT,
                    Reason.SCALING,
                    Reason.OBJECTS_MISSING,
                    Reason.PODS_NOT_READY,
                    Reason.ROUTER_NOT_READY,
                )
                for _, (r, _) in problems
            )
            conditions = set_(ConditionType.PROGRESSING, "True" if moving else "False", reason, detail)
        else:
            msg = f"prefill {desired['prefill']}, decode {desired['decode']} ready on revision {revision}"
            conditions = set_(ConditionType.READY, "True", Reason.ALL_READY, msg)
            conditions = set_(ConditionType.PROGRESSING, "False", Reason.RECONCILED, "rollout complete")
        conditions = degraded_from_transfer(conditions, generation, now)
        if secret_error := missing_secret(observed, previous):  # pods cannot start: worse than transfer
            conditions = set_(ConditionType.DEGRADED, "True", Reason.SECRET_MISSING, secret_error)
    status["conditions"] = conditions
    return status


def missing_secret(observed: Observed, previous: dict[str, Any]) -> str:
    """This reconcile's missing-Secret message, or the last one when this update did not check."""
    if observed.secret_error is not None:
        return observed.secret_error
    prev = condition(previous, ConditionType.DEGRADED)
    return prev["message"] if prev and prev.get("reason") == Reason.SECRET_MISSING.value else ""


def degraded_from_transfer(
    conditions: list[dict[str, Any]], generation: int, now: str
) -> list[dict[str, Any]]:
    """Degraded mirrors TransferHealthy=False when nothing worse (spec/apply failure) is going on."""
    transfer = next((c for c in conditions if c["type"] == ConditionType.TRANSFER_HEALTHY.value), None)
    if transfer and transfer["status"] == "False":
        return set_condition(
            conditions,
            ConditionType.DEGRADED,
            "True",
            Reason.TRANSFER_UNHEALTHY,
            f"{transfer['reason']}: {transfer['message']}",
            generation,
            now,
        )
    return set_condition(
        conditions, ConditionType.DEGRADED, "False", Reason.RECONCILED, "no known faults", generation, now
    )


def condition(status: dict[str, Any], ctype: ConditionType) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c.get("type") == ctype.value), None)
