"""Status step: observed StatefulSets/Deployment -> the CR's status and conditions (pure, no API access).

`summarize` builds the whole status from every observation (the reconcile's faults, the workloads, the
metrics timer's transfer verdict) and `conditions` derives every condition from them with one
precedence (DEGRADED_ORDER); publish.py is the one writer. `set_condition` keeps lastTransitionTime
still unless a condition flips, so GitOps tools and `kubectl wait` see real changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvferry.operator.spec import names


class ConditionType(str, Enum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    TRANSFER_HEALTHY = "TransferHealthy"
    DEGRADED = "Degraded"
    GANG_ADMITTED = "GangAdmitted"  # whether P and D are admitted together (admission.py)


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
    CONFLICT = "Conflict"  # Degraded: an object of a name we render exists and is not this CR's
    # TransferHealthy reasons (set by the metrics timer, see transfer_metrics.py)
    TRANSFERS_OK = "TransfersSucceeding"
    NO_TRAFFIC = "NoTransfersYet"
    TRANSFER_FAILURES = "TransferFailures"
    LAYOUT_MISMATCH = "KVLayoutMismatch"  # transfers refused: P's and D's KV layouts cannot be mapped
    SAMPLE_MISMATCH = "KVSampleMismatch"  # the sentinel found decode's KV is not what prefill sent
    WRONG_BACKEND = "UCXOnEFA"
    DECODE_RECOMPUTES = "DecodeRecomputes"
    METRICS_UNAVAILABLE = "MetricsUnavailable"
    # TransferHealthy from the pods' own status: termination messages, image pulls (podchecks.py)
    PREFLIGHT_FAILED = "PreflightFailed"
    INJECT_FAILED = "ConnectorInjectFailed"
    IMAGE_PULL_FAILED = "ImagePullFailed"  # a pod's image cannot be pulled (ErrImagePull, ImagePullBackOff)
    # GangAdmitted reasons (admission.py, at reconcile and each metrics interval)
    KUEUE_ADMITTED = "KueueAdmitted"
    KUEUE_PENDING = "KueuePending"
    GANG_SCHEDULER_MISSING = "GangSchedulerMissing"
    GANG_NOT_REQUESTED = "GangNotRequested"
    NO_GANG_SCHEDULER = "NoGangScheduler"


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
    CONFLICT = "Conflict"  # an object of a rendered name belongs to someone else: left untouched


# Degraded's reason when several faults hold: the first of these. The reconcile observes all but the
# last; a writer that did not reconcile carries the reconcile's top fault from status.
DEGRADED_ORDER = (
    Reason.INVALID_SPEC,
    Reason.APPLY_FAILED,
    Reason.CONFLICT,
    Reason.SECRET_MISSING,
    Reason.TRANSFER_UNHEALTHY,
)
RECONCILE_FAULTS = DEGRADED_ORDER[:-1]
# The cluster does not hold what the CR asks for: Ready and Progressing are False for these.
BLOCKING = (Reason.INVALID_SPEC, Reason.APPLY_FAILED, Reason.CONFLICT)
MOVING = (
    Reason.ROLLING_OUT,
    Reason.SCALING,
    Reason.OBJECTS_MISSING,
    Reason.PODS_NOT_READY,
    Reason.ROUTER_NOT_READY,
)
Verdict = tuple[str, Reason, str]  # TransferHealthy (status, reason, message)


@dataclass
class Observed:
    """What exists in the cluster for one CR (objects as the API returned them, None if absent)."""

    statefulsets: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    router: dict[str, Any] | None = None
    # The reconcile's findings (reason -> message, each of RECONCILE_FAULTS); None = not looked
    # (refresh, timer): the last reconcile's top fault is carried from status.
    faults: dict[Reason, str] | None = None
    # The metrics timer's TransferHealthy verdict and transfer summary; None = carried from status.
    transfer: Verdict | None = None
    transfer_summary: dict[str, Any] | None = None
    # The reconcile's GangAdmitted verdict (admission.py); None = carried from status.
    gang: Verdict | None = None
    # Where the engine pods landed (landed.py, from the metrics timer's pod list); None = carried.
    placement: dict[str, Any] | None = None


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
    """The full new status from every observation; what `observed` lacks is carried from `previous`."""
    transfer = (
        previous.get("transfer", {}) if observed.transfer_summary is None else observed.transfer_summary
    )
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "revision": revision,
        "endpoint": f"http://{names.service_name(cr_name)}.{namespace}.svc:{names.HTTP_PORT}",
        "transfer": transfer,
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
    faults = carried_faults(previous) if observed.faults is None else observed.faults
    verdict = observed.transfer or carried_verdict(previous)
    ready_msg = f"prefill {desired['prefill']}, decode {desired['decode']} ready on revision {revision}"
    status["conditions"] = conditions(
        faults, problems, verdict, ready_msg, list(previous.get("conditions", [])), generation, now
    )
    placement = observed.placement if observed.placement is not None else previous.get("placement")
    if placement is not None:
        status["placement"] = placement
    if observed.gang is not None:  # else GangAdmitted stays as the last reconcile wrote it
        status["conditions"] = set_condition(
            status["conditions"], ConditionType.GANG_ADMITTED, *observed.gang, generation, now
        )
    return status


def conditions(
    faults: dict[Reason, str],
    problems: list[tuple[str, tuple[Reason, str]]],
    verdict: Verdict | None,
    ready_msg: str,
    previous: list[dict[str, Any]],
    generation: int,
    now: str,
) -> list[dict[str, Any]]:
    """Every condition from every observation; Degraded by DEGRADED_ORDER, the same for each writer."""
    found = dict(faults)
    if verdict is not None and verdict[0] == "False":
        found[Reason.TRANSFER_UNHEALTHY] = f"{verdict[1].value}: {verdict[2]}"
    top = next((r for r in DEGRADED_ORDER if r in found), None)
    conds = previous

    def set_(ctype: ConditionType, state: str, reason: Reason, message: str) -> None:
        nonlocal conds
        conds = set_condition(conds, ctype, state, reason, message, generation, now)

    if top in BLOCKING:
        set_(ConditionType.READY, "False", top, found[top])
        set_(ConditionType.PROGRESSING, "False", top, found[top])
    elif problems:
        reason = problems[0][1][0]
        detail = "; ".join(f"{who}: {m}" for who, (_, m) in problems)
        set_(ConditionType.READY, "False", reason, detail)
        moving = any(r in MOVING for _, (r, _) in problems)
        set_(ConditionType.PROGRESSING, "True" if moving else "False", reason, detail)
    else:
        set_(ConditionType.READY, "True", Reason.ALL_READY, ready_msg)
        set_(ConditionType.PROGRESSING, "False", Reason.RECONCILED, "rollout complete")
    if verdict is not None:
        set_(ConditionType.TRANSFER_HEALTHY, *verdict)
    if top is None:
        set_(ConditionType.DEGRADED, "False", Reason.RECONCILED, "no known faults")
    else:
        set_(ConditionType.DEGRADED, "True", top, found[top])
    return conds


def _reason(value: Any) -> Reason | None:
    try:
        return Reason(value)
    except ValueError:  # written by another operator version
        return None


def carried_faults(previous: dict[str, Any]) -> dict[Reason, str]:
    """The last reconcile's top fault, as its Degraded condition shows it."""
    degraded = condition(previous, ConditionType.DEGRADED)
    reason = _reason((degraded or {}).get("reason"))
    if degraded and degraded.get("status") == "True" and reason in RECONCILE_FAULTS:
        return {reason: degraded.get("message", "")}
    return {}


def carried_verdict(previous: dict[str, Any]) -> Verdict | None:
    """The metrics timer's last TransferHealthy verdict."""
    health = condition(previous, ConditionType.TRANSFER_HEALTHY)
    reason = _reason((health or {}).get("reason"))
    if health is None or reason is None:
        return None
    return health["status"], reason, health.get("message", "")


def condition(status: dict[str, Any], ctype: ConditionType) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c.get("type") == ctype.value), None)
