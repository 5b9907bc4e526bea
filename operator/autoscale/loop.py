"""Autoscale step (I/O): one evaluation per CR with `spec.autoscaling`, every metrics interval.

Reads each role's StatefulSet (the watch's copy, else one read) and its engine pods' /metrics (the same
operator-chosen URLs and bounded fetch as the transfer-status timer), turns two consecutive scrapes into
a window (signals.py), plans (planner.py, pure), writes the decisions (writer.py) and publishes
`status.autoscaling` through the one optimistic status writer. Returns the events to post: one per
replica change, one per failed write.

The planner's memory (last scrape, recent recommendations) lives in this process: after an operator
restart the first evaluation only sets the baseline and nothing shrinks until the stabilisation
window has filled again, so a restart can delay a scale-down but never cause one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvferry.operator.autoscale import writer
from kvferry.operator.autoscale.planner import Decision, History, Plan, plan
from kvferry.operator.autoscale.signals import EngineSample, Scrape, Window, parse_engine, window
from kvferry.operator.reconcile.apply import Kube, KubeError, NotControlled, not_controlled, now_iso
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import Inference, Meta, names
from kvferry.operator.spec.autoscaling import Autoscaling
from kvferry.operator.status.publish import Watched, no_watch, write_status
from kvferry.operator.status.scrape import Fetch, engine_pods_of, metrics_urls
from kvferry.operator.status.transfer import human

log = logging.getLogger("kvferry.operator.autoscale")


class ScaleEvent(str, Enum):
    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    SCALE_FAILED = "ScaleFailed"


Event = tuple[str, ScaleEvent, str]  # (Normal|Warning, reason, message)


@dataclass
class Memory:
    history: History = field(default_factory=History)
    scrape: Scrape = field(default_factory=dict)
    scraped_at: float = 0.0  # monotonic time of `scrape`


def read_engines(
    kube: Kube, cr: Inference, cfg: OperatorConfig, fetch: Fetch, owners: dict[str, str]
) -> Scrape:
    """Role -> source -> parsed sample of every running engine pod that answered with metrics, of the
    pods the role's StatefulSet (owners: role -> its UID) controls."""
    meta = cr.meta
    pods = kube.list("Pod", meta.namespace, {names.LABEL_NAME: names.fit(meta.name)})
    pods = engine_pods_of(pods, owners)
    out: dict[str, dict[str, EngineSample]] = {}
    for role, urls in metrics_urls(pods, cfg.metrics_url, meta.name).items():
        out[role] = {}
        for url in urls:
            if (text := fetch(url)) is None:
                continue  # not answering: the window counts it as absent
            try:
                out[role][url] = parse_engine(text)
            except ValueError:
                log.info("autoscale: %s is not Prometheus text; skipped", url)
    return out


def role_status(d: Decision) -> dict[str, Any]:
    return {"current": d.current, "desired": d.desired, "reason": d.reason}


def status_of(spec: Autoscaling, w: Window, p: Plan, last: dict[str, Any], now: str) -> dict[str, Any]:
    """status.autoscaling: targets, what was observed, and the planner's decision with its reason."""
    pct = spec.percentile
    moved = [d for d in p.decisions() if d.action != "hold"]
    latest = "; ".join(f"{d.role} {d.current}->{d.desired}: {d.reason}" for d in moved)
    return {
        "targets": f"TTFT {pct} {human(spec.ttft_seconds)}, ITL {pct} {human(spec.itl_seconds)}",
        "latency": (
            f"TTFT {human(w.ttft) or '-'}/{human(spec.ttft_seconds)} ITL {human(w.itl) or '-'}/"
            f"{human(spec.itl_seconds)}"
        ),
        "ttftSeconds": w.ttft,
        "itlSeconds": w.itl,
        "requests": w.requests,
        "prefillWaiting": int(w.prefill_waiting),
        "decodeWaiting": int(w.decode_waiting),
        "decodeKvUsage": round(w.decode_kv_usage, 3),
        "prefill": role_status(p.prefill),
        "decode": role_status(p.decode),
        "summary": " ".join(
            f"{d.role[0].upper()} {d.current}" + (f"->{d.desired}" if d.action != "hold" else "")
            for d in p.decisions()
        ),
        "output": spec.output,
        "lastDecision": latest or last.get("lastDecision", ""),
        "lastDecisionTime": now if latest else last.get("lastDecisionTime", ""),
    }


class Autoscaler:
    """The planner's memory per CR (by uid) and the evaluation; one instance per operator process."""

    def __init__(self) -> None:
        self._memory: dict[str, Memory] = {}
        self._lock = threading.Lock()

    def forget(self, meta: Meta) -> None:
        with self._lock:
            self._memory.pop(meta.uid, None)
        writer.forget(meta.namespace, meta.name)

    def evaluate(
        self,
        kube: Kube,
        cr: Inference,
        cfg: OperatorConfig,
        fetch: Fetch,
        watched: Watched = no_watch,
        now: float | None = None,
    ) -> list[Event]:
        """One evaluation: plan from the engines' metrics, write it, publish status; the events."""
        ns, name, uid = cr.meta.namespace, cr.meta.name, cr.meta.uid
        if not cr.valid:
            return []  # the reconcile reports an invalid spec
        spec = cr.spec.autoscaling
        if spec is None or not cr.revision:
            return []  # not autoscaled, or not reconciled yet
        sets = {r: watched(r) or kube.get("StatefulSet", ns, names.role_name(name, r)) for r in names.ROLES}
        if any(s is None for s in sets.values()):
            return []  # the reconcile creates them
        if any(not_controlled(s, uid, "StatefulSet") for s in sets.values() if s):
            # A StatefulSet of our name that this CR does not control (the reconcile reports the
            # Conflict): neither plan from its metrics nor scale it. writer.scale checks again.
            log.info("autoscale %s/%s: a role's StatefulSet is not this CR's; not evaluated", ns, name)
            return []
        current = {r: int(s["spec"].get("replicas", 1)) for r, s in sets.items() if s}
        ready = {r: int(s.get("status", {}).get("readyReplicas", 0)) for r, s in sets.items() if s}
        owners = {r: s["metadata"].get("uid", "") for r, s in sets.items() if s}
        scrape = read_engines(kube, cr, cfg, fetch, owners)
        at = time.monotonic() if now is None else now
        key = uid or f"{ns}/{name}"
        with self._lock:
            memory = self._memory.setdefault(key, Memory())
        elapsed = at - memory.scraped_at if memory.scrape else 0.0
        w = window(memory.scrape, scrape, spec.percentile, elapsed)
        log.debug("autoscale %s/%s: %s", ns, name, w)
        result = plan(spec, w, current, ready, memory.history, at)
        memory.scrape, memory.history, memory.scraped_at = scrape, result.history, at
        events = self._write(kube, cr, spec, result, sets)
        stamp = now_iso()
        write_status(
            kube,
            cr.body,
            lambda prev: {"autoscaling": status_of(spec, w, result, prev.get("autoscaling") or {}, stamp)},
        )
        return events

    def _write(
        self, kube: Kube, cr: Inference, spec: Autoscaling, p: Plan, sets: dict[str, Any]
    ) -> list[Event]:
        ns, name = cr.meta.namespace, cr.meta.name
        last = cr.status.get("autoscaling") or {}
        events: list[Event] = []
        for d in p.decisions():
            writer.publish_desired(ns, name, d.role, d.desired)
            if d.action == "hold":
                continue
            what = f"{d.role} {d.current} -> {d.desired}: {d.reason}"
            if spec.output == "metrics":
                if (last.get(d.role) or {}).get("desired") != d.desired:  # once per new value
                    events.append(("Normal", _reason(d), f"{what} (published for an external scaler)"))
                continue
            try:
                writer.scale(kube, sets[d.role], cr.meta.uid, d.desired)
            except NotControlled as exc:
                events.append(("Warning", ScaleEvent.SCALE_FAILED, f"{what}: not written ({exc})"))
                continue
            except KubeError as exc:
                if exc.status == 409:  # the StatefulSet moved since it was read: plan again from it
                    log.info("autoscale %s/%s: %s not written, changed since read", ns, name, d.role)
                else:
                    events.append(("Warning", ScaleEvent.SCALE_FAILED, f"{what}: not written ({exc})"))
                continue
            log.info("autoscale %s/%s: %s", ns, name, what)
            events.append(("Normal", _reason(d), what))
        return events


def _reason(d: Decision) -> ScaleEvent:
    return ScaleEvent.SCALED_UP if d.action == "up" else ScaleEvent.SCALED_DOWN
