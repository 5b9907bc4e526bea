"""Autoscale planner: one window of signals -> desired replicas per role, each with its reason (pure).

Prefill is scaled to the TTFT target, decode to the ITL target, each like the HPA's rule
`desired = ceil(current * observed / target)` outside a 10 % tolerance, at most doubling per decision:
- Blame: a TTFT over target with requests queued on decode and none on prefill is decode's (a full
  decode cannot admit the first token), so decode grows and prefill holds. Prefill also holds when its
  own TTFT percentile is within target: the clients' wait was elsewhere.
- Scale-up is immediate; scale-down is one pod per evaluation, only while latency sits below
  `scaleDownBelow` x target with no queue (or the role is idle), and only when every evaluation
  over the stabilisation window recommended shrinking the role (the HPA's scale-down rule, in
  steps). After a restart the window must fill before anything shrinks.
- Low latency alone does not show headroom: two prefill pods at 65 % busy answer fast, and one would
  be overloaded (the load step of bench/autoscale_bench.py flapped so). Prefill shrinks only when its
  measured load fits on one pod fewer: busy x N / (N - 1) below SCALE_IN_BUSY.
- A role whose pods are not all ready holds: new pods loading a model do not lower latency yet, and
  scaling again on the same symptom would run to maxReplicas.
- Shrinking both at once, prefill goes first and decode waits (docs/scaling-and-drain.md: a prefill
  without a decode's registration holds KV for a whole lease).
- Bounds last: each role within [min, max], then the prefill:decode ratio, met by growing the role
  that is short (the spec's rules guarantee that is possible within the bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvferry.operator.autoscale.signals import Window
from kvferry.operator.spec.autoscaling import Autoscaling
from kvferry.operator.status.transfer import human

TOLERANCE = 0.1  # as the HPA's default: within 10 % of the target nothing moves
MAX_STEP = 2.0  # at most double a role per decision
KV_FULL = 0.9  # decode KV cache usage above which waiting requests mean decode is out of room
SCALE_IN_BUSY = 0.7  # prefill shrinks only if one pod fewer would be at most this busy
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Recommendation:
    """One evaluation's raw, bounded recommendation per role as a change of replicas (before
    stabilisation): negative = shrink."""

    at: float
    prefill: int
    decode: int


@dataclass(frozen=True)
class History:
    """What the planner remembers between evaluations (kept by the caller, in memory)."""

    started: float | None = None  # first evaluation: scale-down waits until the window has filled
    recent: tuple[Recommendation, ...] = ()


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    reason: str

    @property
    def action(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


@dataclass(frozen=True)
class Plan:
    prefill: Decision
    decode: Decision
    history: History

    def decisions(self) -> tuple[Decision, Decision]:
        return self.prefill, self.decode


def _grow(current: int, observed: float, target: float) -> int:
    return max(current + 1, math.ceil(current * min(observed / target, MAX_STEP)))


def _latency(role: str, observed: float | None, target: float, pct: str) -> str:
    name = "TTFT" if role == "prefill" else "ITL"
    return f"{name} {pct} {human(observed) or 'n/a'} (target {human(target)})"


def raw(role: str, spec: Autoscaling, w: Window, current: int) -> tuple[int, str]:
    """The role's recommendation from its own signals and why, before bounds and stabilisation."""
    mine = role == "prefill"
    observed, target = (w.ttft, spec.ttft_seconds) if mine else (w.itl, spec.itl_seconds)
    waiting = w.prefill_waiting if mine else w.decode_waiting
    running = w.prefill_running if mine else w.decode_running
    says = _latency(role, observed, target, spec.percentile)
    ttft_over = w.ttft is not None and w.ttft > spec.ttft_seconds * (1 + TOLERANCE)
    decode_blocked = ttft_over and w.decode_waiting > 0 and w.prefill_waiting == 0
    if mine and decode_blocked:
        return current, f"{_latency(role, w.ttft, target, spec.percentile)} but queued on decode, not prefill"
    if mine and ttft_over and w.prefill_ttft is not None and w.prefill_ttft <= target * (1 + TOLERANCE):
        # Clients waited, but not on prefill: its own first tokens came in time (e.g. decode's backlog
        # draining after a decode step; growing prefill would not help).
        return current, f"{says} but prefill's own TTFT is {human(w.prefill_ttft)}: not prefill's"
    if not mine and decode_blocked:
        return _grow(current, w.ttft or 0.0, spec.ttft_seconds), (
            f"{_latency('prefill', w.ttft, spec.ttft_seconds, spec.percentile)} with "
            f"{w.decode_waiting:.0f} requests queued on decode"
        )
    if observed is not None and observed > target * (1 + TOLERANCE):
        return _grow(current, observed, target), says
    if not mine and w.decode_kv_usage >= KV_FULL and w.decode_waiting > 0:
        return current + 1, f"decode KV cache {w.decode_kv_usage:.0%} full, {w.decode_waiting:.0f} waiting"
    if w.compared == 0:  # no decode engine answered twice yet: nothing is known about latency
        return current, f"{says}; no metrics window yet"
    if observed is None and waiting > 0 and w.requests == 0:
        return current + 1, f"{waiting:.0f} requests waiting on {role}, none finished in the window"
    if observed is not None and observed < target * spec.scale_down_below and waiting == 0:
        if mine and (after := _busy_after_scale_in(w, current)) is not None and after > SCALE_IN_BUSY:
            return current, (
                f"{says}: below {spec.scale_down_below:.0%} of target, but prefill is {w.prefill_busy:.0%} "
                f"busy: {after:.0%} on {current - 1}"
            )
        return current - 1, f"{says}: below {spec.scale_down_below:.0%} of target"
    if observed is None and waiting == 0 and running == 0 and w.requests == 0:
        return current - 1, f"{role} idle"
    return current, says


def _busy_after_scale_in(w: Window, current: int) -> float | None:
    """How busy prefill's pods would be with one fewer: None when unknown or nothing to shrink."""
    if w.prefill_busy is None or current <= 1:
        return None
    return w.prefill_busy * current / (current - 1)


def _bounded(role: str, spec: Autoscaling, desired: int, reason: str) -> tuple[int, str]:
    bounds = getattr(spec, role)
    if desired > bounds.max_replicas:
        return bounds.max_replicas, f"{reason}; at maxReplicas {bounds.max_replicas}"
    if desired < bounds.min_replicas:
        return bounds.min_replicas, f"{reason}; at minReplicas {bounds.min_replicas}"
    return desired, reason


def _stabilised(
    role: str, desired: int, current: int, reason: str, spec: Autoscaling, h: History, now: float
) -> tuple[int, str]:
    """Shrink by one pod, only if every evaluation in the window recommended shrinking this role."""
    if desired >= current:
        return desired, reason
    window = spec.scale_down_stabilization_seconds
    if window and (h.started is None or now - h.started < window):
        return current, f"{reason}; scale-down waits for {window}s of history"
    if any(getattr(r, role) >= 0 for r in h.recent if now - r.at <= window):
        return current, f"{reason}; held by the {window}s stabilisation window"
    return current - 1, reason


def _ratio(spec: Autoscaling, p: Decision, d: Decision) -> tuple[Decision, Decision]:
    """Meet the prefill:decode ratio bounds by growing the short role up to its max, then shrinking
    the other to fit (the spec's rules make both bounds reachable within the replica bounds)."""
    lo, hi = spec.ratio.min, spec.ratio.max
    if hi is not None and p.desired > hi * d.desired:
        need = min(math.ceil(p.desired / hi), spec.decode.max_replicas)
        d = replace(d, desired=need, reason=f"{d.reason}; ratio max {hi:g} needs decode {need}")
        if p.desired > hi * need:
            keep = max(spec.prefill.min_replicas, math.floor(hi * need))
            p = replace(p, desired=keep, reason=f"{p.reason}; ratio max {hi:g} caps prefill at {keep}")
    if lo is not None and p.desired < lo * d.desired:
        need = min(math.ceil(lo * d.desired), spec.prefill.max_replicas)
        p = replace(p, desired=need, reason=f"{p.reason}; ratio min {lo:g} needs prefill {need}")
        if p.desired < lo * d.desired:
            keep = max(spec.decode.min_replicas, math.floor(need / lo))
            d = replace(d, desired=keep, reason=f"{d.reason}; ratio min {lo:g} caps decode at {keep}")
    return p, d


def plan(
    spec: Autoscaling,
    w: Window,
    current: dict[str, int],
    ready: dict[str, int],
    history: History,
    now: float,
) -> Plan:
    """Desired replicas per role for this window; `history` in, the updated history out."""
    recommended: dict[str, int] = {}
    out: dict[str, Decision] = {}
    for role in ROLES:
        cur = current[role]
        desired, reason = _bounded(role, spec, *raw(role, spec, w, cur))
        recommended[role] = desired - cur
        bounds = getattr(spec, role)
        inside = bounds.min_replicas <= cur <= bounds.max_replicas
        if inside and ready.get(role, 0) < cur and desired != cur:
            desired, reason = cur, f"{reason}; waiting for {cur - ready.get(role, 0)} pods to become ready"
        if inside:  # outside its bounds (the spec changed) a role moves to them at once
            desired, reason = _stabilised(role, desired, cur, reason, spec, history, now)
        out[role] = Decision(role, cur, desired, reason)
    p, d = out["prefill"], out["decode"]
    if p.action == "down" and d.action == "down" and d.current <= spec.decode.max_replicas:
        d = replace(d, desired=d.current, reason=f"{d.reason}; waits for prefill to shrink first")
    p, d = _ratio(spec, p, d)
    keep = spec.scale_down_stabilization_seconds
    recent = tuple(r for r in history.recent if now - r.at <= keep)
    entry = Recommendation(now, recommended["prefill"], recommended["decode"])
    started = now if history.started is None else history.started
    return Plan(p, d, History(started, (*recent, entry)))
