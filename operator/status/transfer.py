"""Transfer-metrics step: connector/vLLM Prometheus text -> transfer summary + TransferHealthy (pure).

The connector's metric names, labels and label values come from kvferry.contracts.metrics, the
constants the connector exports by; vLLM's are named below. The status timer (reconcile.py) fetches
each engine pod's /metrics and hands the texts here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvferry.contracts import metrics as m
from kvferry.contracts import promtext
from kvferry.operator.status import metricstext
from kvferry.operator.status.conditions import Reason

# Counted on the producer (prefill) pods, which issue the writes; the vLLM names are the upstream
# NixlConnector's, used when connector=vllm. kvferry names: kvferry.contracts.metrics.
TRANSFERS = (m.total(m.TRANSFERS), "vllm:nixl_xfer_time_seconds_count")
FAILURES = (m.total(m.TRANSFER_FAILURES), "vllm:nixl_num_failed_transfers_total")
# Transfer time: the connector's producer-side match-to-WRITE-done histogram (docs/metrics.md).
HISTOGRAMS = (m.MATCH_TO_DONE_SECONDS, "vllm:nixl_xfer_time_seconds")
# On decode pods: where prompt tokens came from (computed locally vs received as KV).
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
LOCAL, EXTERNAL = "local_compute", "external_kv_transfer"
# On both roles: prompt tokens looked up in vLLM's prefix cache, and those found (counters in tokens).
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
# Decode computing more than this share of prompt tokens itself means KV is not arriving.
RECOMPUTE_SHARE = 0.5


@dataclass
class Sample:
    """Totals from one or more pods' metrics."""

    transfers: float = 0.0
    failures: float = 0.0
    failures_by_reason: dict[str, float] = field(default_factory=dict)
    buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count
    local_tokens: float = 0.0
    external_tokens: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    backends: set[str] = field(default_factory=set)
    ucx_on_efa: bool = False
    failed_checks: set[str] = field(default_factory=set)  # other start-up checks at 0 (e.g. efa_device)
    held: float = 0.0  # decode receives held for a producer that never answered (a bounded leak)


# Failure reasons a verdict depends on: kept whatever else a text reports (metricstext.reason).
ACTED_ON = frozenset({m.LAYOUT_MISMATCH})
# The families parse() reads (metricstext.relevant keeps only these before parsing).
READ = ("kvferry_", "vllm:nixl_", TOKENS_BY_SOURCE, "vllm:prefix_cache_")


def parse(text: str) -> Sample:
    """Parse one pod's /metrics text. Raises ValueError on text that is not Prometheus exposition."""
    out = Sample()
    for s in promtext.samples(metricstext.relevant(text, READ)):
        if s.name.startswith("kvferry_") and m.BACKEND in s.labels:
            out.backends.add(s.labels[m.BACKEND])
        if s.name == m.PREFLIGHT_OK:  # start-up checks: backend_<NAME> 1 names a loaded backend
            check = s.labels.get(m.CHECK, "")
            if check.startswith(m.CHECK_BACKEND) and s.value == 1:
                out.backends.add(check.removeprefix(m.CHECK_BACKEND))
            out.ucx_on_efa |= check == m.CHECK_UCX_ON_EFA and s.value == 0
            if s.value == 0 and check != m.CHECK_UCX_ON_EFA:
                out.failed_checks.add(check)
        elif s.name == m.PENDING and s.labels.get(m.KIND) == m.HELD:
            out.held += s.value
        elif s.name in TRANSFERS:
            out.transfers += s.value
        elif s.name in FAILURES:
            out.failures += s.value
            label = s.labels.get(m.REASON, "unknown")
            reason = metricstext.reason(label, out.failures_by_reason, ACTED_ON)
            out.failures_by_reason[reason] = out.failures_by_reason.get(reason, 0) + s.value
        elif s.name in {h + "_bucket" for h in HISTOGRAMS}:
            le = float(s.labels["le"])
            out.buckets[le] = out.buckets.get(le, 0) + s.value
        elif s.name == PREFIX_QUERIES:
            out.prefix_queries += s.value
        elif s.name == PREFIX_HITS:
            out.prefix_hits += s.value
        elif s.name == TOKENS_BY_SOURCE:
            if s.labels.get("source") == LOCAL:
                out.local_tokens += s.value
            elif s.labels.get("source") == EXTERNAL:
                out.external_tokens += s.value
    return out


def merge(samples: list[Sample]) -> Sample:
    total = Sample()
    for s in samples:
        total.transfers += s.transfers
        total.failures += s.failures
        total.held += s.held
        for k, v in s.failures_by_reason.items():
            total.failures_by_reason[k] = total.failures_by_reason.get(k, 0) + v
        for le, v in s.buckets.items():
            total.buckets[le] = total.buckets.get(le, 0) + v
        total.local_tokens += s.local_tokens
        total.external_tokens += s.external_tokens
        total.prefix_queries += s.prefix_queries
        total.prefix_hits += s.prefix_hits
        total.backends |= s.backends
        total.ucx_on_efa |= s.ucx_on_efa
        total.failed_checks |= s.failed_checks
    return total


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """histogram_quantile: linear interpolation inside the bucket holding the q-th observation."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower  # the +Inf bucket has no upper bound: report the last finite one
            width = count - below
            return lower + (le - lower) * ((rank - below) / width if width else 1.0)
        lower, below = le, count
    return lower


def human(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def _increase(now: float, before: float) -> float:
    """Counter increase; a drop means pods restarted and counters reset."""
    return now if now < before else now - before


def hit_rate(hits: float, queries: float) -> str:
    """A prefix-cache hit rate for `kubectl get` (e.g. 42%); empty before any lookup."""
    return f"{100 * hits / queries:.0f}%" if queries > 0 else ""


def layout_refusals(producer: Sample, consumer: Sample) -> float:
    """Transfers either side refused because the two KV layouts cannot be mapped."""
    return sum(s.failures_by_reason.get(m.LAYOUT_MISMATCH, 0) for s in (producer, consumer))


def sample_mismatches(consumer: Sample) -> float:
    """Receives the sentinel failed: decode's sampled KV was not what prefill digested."""
    return consumer.failures_by_reason.get(m.SAMPLE_MISMATCH, 0)


def health(
    producer: Sample, consumer: Sample, previous: dict[str, Any], efa: bool, scraped: int
) -> tuple[str, Reason, str]:
    """TransferHealthy (status, reason, message) for this scrape against the previous summary."""
    if scraped == 0:
        return "Unknown", Reason.METRICS_UNAVAILABLE, "no engine pod metrics could be read"
    wrong = sorted(b for b in producer.backends | consumer.backends if b != "LIBFABRIC")
    if producer.ucx_on_efa or consumer.ucx_on_efa:
        wrong = wrong or ["UCX"]
    by_role = (("prefill", producer), ("decode", consumer))  # messages name the pods to look at
    if (efa and wrong) or producer.ucx_on_efa or consumer.ucx_on_efa:
        roles = [role for role, s in by_role if s.ucx_on_efa or (efa and s.backends - {"LIBFABRIC"})]
        who = " and ".join(roles) or "engine"
        return (
            "False",
            Reason.WRONG_BACKEND,
            (
                f"{who} pods run NIXL backend {', '.join(wrong)} on EFA nodes; only LIBFABRIC reaches EFA "
                "bandwidth (UCX falls back to TCP)"
            ),
        )
    checks = [f"{role} {check}" for role, s in by_role for check in sorted(s.failed_checks)]
    if checks:
        what = ", ".join(checks)
        return (
            "False",
            Reason.PREFLIGHT_FAILED,
            f"start-up checks failed ({what}): see kvferry_preflight_ok and the engine pods' logs",
        )
    wrong_kv = _increase(sample_mismatches(consumer), previous.get("sampleMismatches", 0))
    if wrong_kv > 0:  # first of the transfer verdicts: KV arrived wrong, whatever else is going on
        return (
            "False",
            Reason.SAMPLE_MISMATCH,
            f"{wrong_kv:.0f} receives since the last check held KV other than what prefill sent "
            "(sentinel); they were recomputed",
        )
    refused = _increase(layout_refusals(producer, consumer), previous.get("layoutMismatches", 0))
    if refused > 0:  # before TransferFailures: a refusal is a configuration fault, not load
        return (
            "False",
            Reason.LAYOUT_MISMATCH,
            f"{refused:.0f} transfers refused since the last check: prefill and decode KV layouts "
            "cannot be mapped element by element",
        )
    failed = _increase(producer.failures, previous.get("failures", 0))
    if failed > 0:
        reason = max(
            producer.failures_by_reason, key=producer.failures_by_reason.__getitem__, default="unknown"
        )
        return (
            "False",
            Reason.TRANSFER_FAILURES,
            f"{failed:.0f} transfers failed since the last check ({reason})",
        )
    local = _increase(consumer.local_tokens, previous.get("localTokens", 0))
    external = _increase(consumer.external_tokens, previous.get("externalTokens", 0))
    if local > 0 and local / (local + external) > RECOMPUTE_SHARE:
        return (
            "False",
            Reason.DECODE_RECOMPUTES,
            (
                f"decode computed {local:.0f} of {local + external:.0f} prompt tokens itself since the last "
                "check: KV is not arriving from prefill"
            ),
        )
    if producer.transfers == 0:
        return "Unknown", Reason.NO_TRAFFIC, "no transfers yet"
    return "True", Reason.TRANSFERS_OK, f"{producer.transfers:.0f} transfers, {producer.failures:.0f} failed"


def summarize(
    producer_texts: list[str],
    consumer_texts: list[str],
    *,
    previous: dict[str, Any],
    mode: str,
    efa: bool,
    now: str,
) -> tuple[dict[str, Any], tuple[str, Reason, str]]:
    """New status.transfer and the TransferHealthy verdict from the pods' metric texts.

    Unparseable texts count as unscraped pods rather than failing the whole summary.
    """
    producers: list[Sample] = []
    consumers: list[Sample] = []
    for texts, out in ((producer_texts, producers), (consumer_texts, consumers)):
        for text in texts:
            try:
                out.append(parse(text))
            except ValueError:
                continue
    producer, consumer = merge(producers), merge(consumers)
    # Prefix-cache lookups on both roles, taken before decode's figures may stand in for prefill's.
    prefix_hits = producer.prefix_hits + consumer.prefix_hits
    prefix_queries = producer.prefix_queries + consumer.prefix_queries
    if not (producer.transfers or producer.failures or producer.buckets):
        producer = consumer  # a connector that counts on the receiving side: take decode's figures
    verdict = health(producer, consumer, previous, efa, len(producers) + len(consumers))
    p50, p99 = quantile(producer.buckets, 0.5), quantile(producer.buckets, 0.99)
    summary = {
        "mode": mode,
        "backend": ",".join(sorted(producer.backends | consumer.backends)),
        "transfers": int(producer.transfers),
        "failures": int(producer.failures),
        "p50": human(p50),
        "p99": human(p99),
        "p50Seconds": p50,
        "p99Seconds": p99,
        "localTokens": int(consumer.local_tokens),
        "layoutMismatches": int(layout_refusals(producer, consumer)),
        "sampleMismatches": int(sample_mismatches(consumer)),
        "heldReceives": int(consumer.held),
        "externalTokens": int(consumer.external_tokens),
        "prefixHitRate": hit_rate(prefix_hits, prefix_queries),
        "prefixHitTokens": int(prefix_hits),
        "prefixQueryTokens": int(prefix_queries),
        "lastFailure": previous.get("lastFailure", ""),
        "lastFailureTime": previous.get("lastFailureTime", ""),
        "scrapedPods": len(producers) + len(consumers),
        "lastScrapeTime": now,
    }
    if verdict[1] == Reason.TRANSFER_FAILURES:
        summary["lastFailure"] = max(
            producer.failures_by_reason, key=producer.failures_by_reason.__getitem__, default=""
        )
        summary["lastFailureTime"] = now
    return {k: v for k, v in summary.items() if v is not None}, verdict
