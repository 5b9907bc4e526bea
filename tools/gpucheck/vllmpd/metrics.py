"""What moved, from two scrapes of P's and D's /metrics: counter deltas by label, histogram deltas
and quantiles, one batch's transfer stats, and the wait until the counts reach /metrics."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvferry.contracts.promtext import metric_sum

from .launch import GpuServer

MS = 1000.0


@dataclass
class Hist:
    buckets: list[tuple[float, float]] = field(default_factory=list)  # (upper bound, cumulative count)
    total: float = 0.0  # sum of observations
    count: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


def _labels(key: str) -> dict[str, str]:
    _, _, rest = key.partition("{")
    return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))


def _series_deltas(
    before: Mapping[str, float], after: Mapping[str, float], name: str
) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, change) of every series of `name` in either scrape."""
    for key in set(before) | set(after):
        if key.partition("{")[0] == name:
            yield _labels(key), after.get(key, 0.0) - before.get(key, 0.0)


def delta(before: Mapping[str, float], after: Mapping[str, float], name: str, **labels: str) -> float:
    return metric_sum(dict(after), name, **labels) - metric_sum(dict(before), name, **labels)


def by_label(
    before: Mapping[str, float], after: Mapping[str, float], name: str, label: str
) -> dict[str, float]:
    """Non-zero deltas of `name` summed per value of `label`."""
    out: dict[str, float] = {}
    for labels, change in _series_deltas(before, after, name):
        value = labels.get(label, "")
        out[value] = out.get(value, 0.0) + change
    return {k: v for k, v in sorted(out.items()) if v}


def hist_delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> Hist:
    """A histogram's change between two scrapes, summed over all labels but `le`."""
    counts: dict[float, float] = {}
    for labels, change in _series_deltas(before, after, f"{name}_bucket"):
        le = labels.get("le")
        if le is None:
            continue
        bound = math.inf if le in ("+Inf", "inf") else float(le)
        counts[bound] = counts.get(bound, 0.0) + change
    return Hist(
        sorted(counts.items()), delta(before, after, f"{name}_sum"), delta(before, after, f"{name}_count")
    )


def hist_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus histogram_quantile: linear within the bucket holding rank q * count."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cum in buckets:
        if cum >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is all we know
            inside = cum - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cum
    return lower


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


Scrape = Mapping[str, float]


def _both_sides(p0: Scrape, p1: Scrape, d0: Scrape, d1: Scrape, name: str) -> dict[str, float]:
    """by_label(reason) of P, then D's as consumer:<reason>."""
    consumer = by_label(d0, d1, name, "reason")
    return by_label(p0, p1, name, "reason") | {f"consumer:{k}": v for k, v in consumer.items()}


def transfer_stats(
    p_before: Mapping[str, float],
    p_after: Mapping[str, float],
    d_before: Mapping[str, float],
    d_after: Mapping[str, float],
) -> dict[str, Any]:
    """What the pair's /metrics say moved between two scrapes."""
    p0, p1, d0, d1 = p_before, p_after, d_before, d_after
    write = hist_delta(p0, p1, "kvferry_match_to_done_seconds")
    recv = hist_delta(d0, d1, "kvferry_receive_wait_seconds")
    kv_bytes = delta(p0, p1, "kvferry_transfer_bytes_total")
    source = "vllm:prompt_tokens_by_source_total"
    return {
        "kv_bytes": kv_bytes,
        "producer_transfers": delta(p0, p1, "kvferry_transfers_total", role="producer"),
        "consumer_transfers": delta(d0, d1, "kvferry_transfers_total", role="consumer"),
        "failures": _both_sides(p0, p1, d0, d1, "kvferry_transfer_failures_total"),
        "rejected": _both_sides(p0, p1, d0, d1, "kvferry_rejected_messages_total"),
        "write_count": write.count,
        "write_mean_ms": _scaled(write.mean, MS),
        "write_p50_ms": _scaled(hist_quantile(write.buckets, 0.5), MS),
        "write_p99_ms": _scaled(hist_quantile(write.buckets, 0.99), MS),
        "write_gbps": kv_bytes / write.total / 1e9 if write.total > 0 else None,
        "receive_wait_mean_ms": _scaled(recv.mean, MS),
        "descriptor_modes": by_label(p0, p1, "kvferry_descriptors_per_transfer_count", "mode"),
        "descriptors_mean": hist_delta(p0, p1, "kvferry_descriptors_per_transfer").mean,
        "handoffs": by_label(p0, p1, "kvferry_prefill_handoffs_total", "when"),
        "tokens_external": delta(d0, d1, source, source="external_kv_transfer"),
        "tokens_local": delta(d0, d1, source, source="local_compute"),
        "has_source_metric": any(k.startswith(source) for k in d1),
    }


def wait_for_counts(
    p: GpuServer, d: GpuServer, base_p: Scrape, base_d: Scrape, want: int, timeout_s: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Scrape until both sides report `want` more transfers (the worker journal reaches /metrics
    with vLLM's next stats) or time runs out; returns the last (P, D) scrapes."""
    deadline = time.monotonic() + timeout_s
    while True:
        p_now, d_now = p.metrics(), d.metrics()
        done_p = delta(base_p, p_now, "kvferry_transfers_total", role="producer") >= want
        done_d = delta(base_d, d_now, "kvferry_transfers_total", role="consumer") >= want
        if (done_p and done_d) or time.monotonic() > deadline:
            return p_now, d_now
        time.sleep(0.5)
