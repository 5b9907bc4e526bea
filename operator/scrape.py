"""Scrape step: read the engine pods' /metrics, write status.transfer and the TransferHealthy condition.

Runs from a kopf timer per CR. Fetching is bounded (per-pod timeout) and a pod that does not answer
only lowers `scrapedPods`; parsing and the verdict are in transfer_metrics.py (pure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from kvferry.operator import names, podchecks, remedies, selfmetrics, status, transfer_metrics
from kvferry.operator.apply import Kube, now_iso
from kvferry.operator.config import OperatorConfig
from kvferry.operator.reconcile import Event, write_status
from kvferry.operator.spec import EFA_ACCELERATORS
from kvferry.operator.status import ConditionType, EventReason, Reason

Fetch = Callable[[str], str | None]
# Degraded reasons that outrank transfer health (the reconcile owns them).
_RECONCILE_FAULTS = {Reason.APPLY_FAILED.value, Reason.INVALID_SPEC.value}


def http_fetcher(timeout_s: float) -> Fetch:
    def fetch(url: str) -> str | None:
        try:
            resp = httpx.get(url, timeout=timeout_s)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    return fetch


def metrics_urls(pods: list[dict[str, Any]], template: str) -> dict[str, list[str]]:
    """Role -> URLs of its running engine pods."""
    urls: dict[str, list[str]] = {role: [] for role in names.ROLES}
    for pod in pods:
        meta, st = pod["metadata"], pod.get("status", {})
        role = meta.get("labels", {}).get(names.LABEL_ROLE)
        if role not in urls or st.get("phase") != "Running" or meta.get("deletionTimestamp"):
            continue
        urls[role].append(
            template.format(
                pod=meta["name"],
                pod_ip=st.get("podIP", ""),
                namespace=meta["namespace"],
                port=names.HTTP_PORT,
                role=role,
            )
        )
    return urls


def scrape(kube: Kube, cr: dict[str, Any], cfg: OperatorConfig, fetch: Fetch) -> list[Event]:
    meta, spec = cr["metadata"], cr.get("spec") or {}
    previous = cr.get("status") or {}
    if not previous.get("revision"):
        return []  # nothing rendered yet
    template = meta.get("annotations", {}).get(names.ANNOTATION_METRICS_URL) or cfg.metrics_url
    pods = kube.list("Pod", meta["namespace"], {names.LABEL_NAME: names.fit(meta["name"])})
    refusal = podchecks.start_failure(pods)  # a kvferry start-up step refused: pods never serve
    texts = {
        role: [t for t in map(fetch, urls) if t is not None]
        for role, urls in metrics_urls(pods, template).items()
    }
    kv = spec.get("kvTransfer") or {}
    verdicts = []

    def compute(prev: dict[str, Any]) -> dict[str, Any]:
        now = now_iso()
        summary, verdict = transfer_metrics.summarize(
            texts["prefill"],
            texts["decode"],
            previous=prev.get("transfer") or {},
            mode=kv.get("mode", "push"),
            efa=spec.get("accelerator") in EFA_ACCELERATORS,
            now=now,
        )
        if refusal is not None:
            verdict = ("False", *refusal)
        verdict = (verdict[0], verdict[1], remedies.explain(verdict[1], verdict[2]))
        verdicts.append(verdict)
        gen = prev.get("observedGeneration", 0)
        conditions = status.set_condition(
            prev.get("conditions", []), ConditionType.TRANSFER_HEALTHY, *verdict, gen, now
        )
        degraded = status.condition({"conditions": conditions}, ConditionType.DEGRADED)
        if not degraded or degraded.get("reason") not in _RECONCILE_FAULTS:
            conditions = status.degraded_from_transfer(conditions, gen, now)
        before = prev.get("transfer") or {}
        if all(before.get(k) == v for k, v in summary.items() if k != "lastScrapeTime"):
            summary["lastScrapeTime"] = before.get("lastScrapeTime", now)  # unchanged: no status write
        return {"transfer": summary, "conditions": conditions}

    patch = write_status(kube, cr, compute)
    state, reason, message = verdicts[-1]
    selfmetrics.SCRAPES.labels("ok" if patch["transfer"]["scrapedPods"] else "no-pods-answered").inc()
    old = status.condition(previous, ConditionType.TRANSFER_HEALTHY)
    if old is not None and old.get("status") == state:
        return []
    kind = "Warning" if state == "False" else "Normal"
    return [(kind, EventReason.TRANSFER_HEALTH, f"TransferHealthy={state} ({reason.value}): {message}")]
