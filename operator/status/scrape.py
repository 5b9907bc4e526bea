"""Scrape step: read the transfer metrics of a CR's engines, write status.transfer and TransferHealthy.

Runs from a kopf timer per CR. By default (KVFERRY_TRANSFER_SOURCE=router) it makes one request, to
the CR's router, which gathers its pool's engine metrics (router/poolstatus.py): the operator's work
grows with CRs, not pods. With `pods` it reads every engine pod's /metrics itself. Fetching is bounded
(timeout, response size cap) and a pod that does not answer only lowers `scrapedPods`; parsing and
the verdict are in transfer.py (pure).

Where it fetches is the operator's own setting (KVFERRY_METRICS_URL), never anything a CR says: a
cluster-wide operator fetching a URL a CR author chose would let anyone who may edit one CR reach cloud
metadata or internal services with the operator's network identity. Only pods the CR's StatefulSets
control (by UID: engine_pods_of) are read, through a template that may hold the fixed placeholders and
nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import msgspec
from kvferry.operator.reconcile import network
from kvferry.operator.reconcile.apply import Kube, not_controlled, now_iso
from kvferry.operator.reconcile.steps import Event
from kvferry.operator.runtime import selfmetrics
from kvferry.operator.runtime.config import OperatorConfig, check_template
from kvferry.operator.spec import EFA_ACCELERATORS, Inference, Meta, names
from kvferry.operator.status import conditions as status
from kvferry.operator.status import gang, landed, podchecks, remedies
from kvferry.operator.status import transfer as transfer_metrics
from kvferry.operator.status.conditions import ConditionType, EventReason, Observed, Verdict
from kvferry.operator.status.publish import Watched, no_watch, publish

Fetch = Callable[[str], str | None]
MAX_METRICS_BYTES = 8 << 20  # vLLM + kvferry /metrics is tens of KiB; anything near this is not metrics


def http_fetcher(timeout_s: float, max_bytes: int = MAX_METRICS_BYTES) -> Fetch:
    """GET a URL: the body on 200, else None. Bounded in time and size; redirects are not followed."""

    def fetch(url: str) -> str | None:
        try:
            with httpx.stream("GET", url, timeout=timeout_s, follow_redirects=False) as resp:
                if resp.status_code != 200:
                    return None
                body = bytearray()
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        return None
                return body.decode(resp.encoding or "utf-8", errors="replace")
        except httpx.HTTPError:
            return None

    return fetch


def metrics_urls(pods: list[dict[str, Any]], template: str, cr_name: str) -> dict[str, list[str]]:
    """Role -> URLs of its running engine pods (pods of the CR's own StatefulSets only)."""
    check_template(template)
    urls: dict[str, list[str]] = {role: [] for role in names.ROLES}
    for pod in pods:
        meta, st = pod["metadata"], pod.get("status", {})
        role = meta.get("labels", {}).get(names.LABEL_ROLE)
        if role not in urls or st.get("phase") != "Running" or meta.get("deletionTimestamp"):
            continue
        if not names.owned_by_role_set(pod, cr_name, role):
            continue
        urls[role].append(
            template.format_map(
                dict(
                    pod=meta["name"],
                    pod_ip=st.get("podIP", ""),
                    namespace=meta["namespace"],
                    port=names.HTTP_PORT,
                    role=role,
                )
            )
        )
    return urls


def _owned_by_router(pod: dict[str, Any], cr_name: str) -> bool:
    """Whether the pod is one of the CR's router Deployment's (through its ReplicaSet, named after it)."""
    prefix = names.router_name(cr_name) + "-"
    refs = pod["metadata"].get("ownerReferences") or []
    return any(
        r.get("controller") and r.get("kind") == "ReplicaSet" and str(r.get("name", "")).startswith(prefix)
        for r in refs
    )


def router_url(pods: list[dict[str, Any]], template: str, cr_name: str) -> str | None:
    """The pool-metrics URL of one running router pod of the CR (None: no router runs)."""
    check_template(template)
    for pod in pods:
        meta, st = pod["metadata"], pod.get("status", {})
        if meta.get("labels", {}).get(names.LABEL_ROLE) != "router" or st.get("phase") != "Running":
            continue
        if meta.get("deletionTimestamp") or not _owned_by_router(pod, cr_name):
            continue
        fields = dict(
            pod=meta["name"], pod_ip=st.get("podIP", ""), namespace=meta["namespace"], port=names.HTTP_PORT
        )
        return template.format_map({**fields, "role": "router"})
    return None


class PoolMetrics(msgspec.Struct):
    """The router's answer (router/poolstatus.py): engine metric texts by role."""

    prefill: list[str]
    decode: list[str]


def texts_from_router(
    pods: list[dict[str, Any]], cfg: OperatorConfig, fetch: Fetch, cr_name: str
) -> dict[str, list[str]]:
    """Role -> engine metric texts, read through the CR's router in one request (empty if it did not
    answer, or answered something else: the verdict then says no metrics could be read)."""
    url = router_url(pods, cfg.pool_metrics_url, cr_name)
    body = fetch(url) if url else None
    try:
        pool = msgspec.json.decode(body, type=PoolMetrics) if body is not None else None
    except msgspec.DecodeError:
        pool = None
    return {"prefill": pool.prefill, "decode": pool.decode} if pool else {role: [] for role in names.ROLES}


def texts_from_pods(
    pods: list[dict[str, Any]], cfg: OperatorConfig, fetch: Fetch, cr_name: str
) -> dict[str, list[str]]:
    """Role -> metric texts of every running engine pod, one request each."""
    return {
        role: [t for t in map(fetch, urls) if t is not None]
        for role, urls in metrics_urls(pods, cfg.metrics_url, cr_name).items()
    }


def _watched_or_read(kube: Kube, meta: Meta, watched: Watched) -> Watched:
    """The watch's copy of each workload, else one read (a timer may fire before the index has it)."""
    kinds = {role: ("StatefulSet", names.role_name(meta.name, role)) for role in names.ROLES}
    kinds["router"] = ("Deployment", names.router_name(meta.name))
    copies = {
        role: watched(role) or kube.get(kind, meta.namespace, name) for role, (kind, name) in kinds.items()
    }
    return lambda role: watched(role) or copies.get(role)


def role_owners(meta: Meta, workloads: Watched) -> dict[str, str]:
    """Role -> UID of its StatefulSet, for the roles whose StatefulSet the CR controls (by UID)."""
    uid = meta.uid
    out = {}
    for role in names.ROLES:
        sts = workloads(role)
        if sts is not None and not_controlled(sts, uid, "StatefulSet") is None:
            out[role] = sts["metadata"].get("uid", "")
    return out


def engine_pods_of(pods: list[dict[str, Any]], owners: dict[str, str]) -> list[dict[str, Any]]:
    """`pods` without the engine pods (role prefill/decode) that no StatefulSet of `owners` (role ->
    UID, role_owners) controls: a pod labelled as this CR's engine but another StatefulSet's (a name
    proves nothing) is neither read nor counted. Other pods (the router's) pass as they are."""
    out = []
    for pod in pods:
        role = (pod["metadata"].get("labels") or {}).get(names.LABEL_ROLE)
        if role not in names.ROLES or (owners.get(role) and not_controlled(pod, owners[role], "Pod") is None):
            out.append(pod)
    return out


def scrape(
    kube: Kube,
    cr: Inference,
    cfg: OperatorConfig,
    fetch: Fetch,
    watched: Watched = no_watch,
    nodes: network.NodeLayers | None = None,
) -> list[Event]:
    """Read the engines' metrics and publish the TransferHealthy verdict (with every other condition);
    with `nodes`, first label the engine pods with their nodes' network layers (network.py). A CR whose
    spec is invalid is left to the reconcile, which reports it."""
    if not cr.valid:
        return []
    meta, spec, previous = cr.meta, cr.spec, cr.status
    workloads = _watched_or_read(kube, meta, watched)
    owners = role_owners(meta, workloads)
    # Nothing rendered yet. A revision is not written while an apply reports a Conflict, yet the
    # roles it did apply serve: their StatefulSets (the CR's own, by UID) are what counts.
    if not previous.get("revision") and not owners:
        return []
    pods = kube.list("Pod", meta.namespace, {names.LABEL_NAME: names.fit(meta.name)})
    pods = engine_pods_of(pods, owners)
    if nodes is not None:
        network.label_pods(kube, pods, owners, nodes)
    refusal = podchecks.start_failure(pods)  # a kvferry start-up step refused: pods never serve
    read = texts_from_router if cfg.transfer_source == "router" else texts_from_pods
    texts = read(pods, cfg, fetch, meta.name)
    verdicts: list[Verdict] = []

    def finding(before: dict[str, Any]) -> tuple[dict[str, Any], Verdict]:
        now = now_iso()
        summary, verdict = transfer_metrics.summarize(
            texts["prefill"],
            texts["decode"],
            previous=before,
            mode=spec.kv_transfer.mode,
            efa=spec.accelerator in EFA_ACCELERATORS,
            now=now,
        )
        if refusal is not None:
            verdict = ("False", *refusal)
        verdicts.append((verdict[0], verdict[1], remedies.explain(verdict[1], verdict[2])))
        if all(before.get(k) == v for k, v in summary.items() if k != "lastScrapeTime"):
            summary["lastScrapeTime"] = before.get("lastScrapeTime", now)  # unchanged: no status write
        return summary, verdicts[-1]

    roles = landed.landed(pods)
    # A Kueue gang's admission moves nothing the operator watches while it waits for quota: read it here.
    observed = Observed(
        placement={**roles, "zone": landed.summary(roles)}, gang=gang.observe_if_kueue(kube, cr)
    )
    patch = publish(kube, cr, observed, workloads, transfer=finding)
    state, reason, message = verdicts[-1]
    selfmetrics.SCRAPES.labels("ok" if patch["transfer"]["scrapedPods"] else "no-pods-answered").inc()
    old = status.condition(previous, ConditionType.TRANSFER_HEALTHY)
    if old is not None and old.get("status") == state:
        return []
    kind = "Warning" if state == "False" else "Normal"
    return [(kind, EventReason.TRANSFER_HEALTH, f"TransferHealthy={state} ({reason.value}): {message}")]
