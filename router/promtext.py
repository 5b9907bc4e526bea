"""Scrape step: parse Prometheus text exposition (vLLM's and the router's /metrics) into flat dicts."""

from __future__ import annotations


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{k="v",...}': value} (labels sorted, so keys are stable)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include all of `labels`."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
