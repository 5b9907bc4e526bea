"""CPU time of contracts/promtext.py against prometheus_client's parser on an engine's /metrics.

The text is a vLLM engine's /metrics with kvferry's connector loaded: vLLM's own metric definitions
(`PrometheusStatLogger` of the installed vLLM, every engine index of a data-parallel engine) and the
connector's (connector/metrics.py), filled with observations, written by prometheus_client as the
engine writes it. `--write` stores one engine's text as the parser tests' fixture.

    python bench/promtext_bench.py --engines 1 8 64 [--write tests/unit/contracts/data/vllm_metrics.txt]

Prints, per text size, one JSON line: CPU ms per parse and per MiB for both parsers, for the whole text
and with the operator's cut first (operator/status/metricstext.py: the families transfer status reads,
then parsed; `_cut_ms` includes the cut). Results: bench/results/promtext_parse.md.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from kvferry.contracts import promtext
from kvferry.operator.status import metricstext, transfer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

LABELS = {"role": ("producer", "consumer"), "backend": ("UCX",), "mode": ("push",), "when": ("first",)}


def _vllm_config(model: str) -> Any:
    """The fields PrometheusStatLogger reads, nothing else configured."""
    cfg = mock.MagicMock()
    cfg.model_config.served_model_name = model
    cfg.model_config.max_model_len = 4096
    cfg.model_config.is_diffusion = False
    cfg.observability_config.show_hidden_metrics = False
    cfg.observability_config.kv_cache_metrics = True
    cfg.observability_config.custom_histogram_buckets = None
    cfg.observability_config.cudagraph_metrics = False
    cfg.observability_config.enable_mfu_metrics = False
    for attr in ("speculative_config", "lora_config", "kv_transfer_config", "ec_transfer_config"):
        setattr(cfg, attr, None)
    cfg.watermark_config = None
    cfg.cache_config.num_gpu_blocks = 4096
    cfg.device_config.device_type = "cpu"
    return cfg


def _fill(metric: Any, rnd: random.Random) -> None:
    if isinstance(metric, Histogram):
        for _ in range(50):
            metric.observe(rnd.expovariate(1.0) * 2)
    elif isinstance(metric, Counter):
        metric.inc(rnd.randint(1, 10**6))
    elif isinstance(metric, Gauge):
        metric.set(rnd.random())


def vllm_text(engines: int) -> str:
    """vLLM's /metrics (vLLM's registry) plus the connector's, `engines` engine indexes."""
    from kvferry.connector import metrics as kvm
    from prometheus_client import REGISTRY
    from vllm.v1.metrics import loggers

    logger = loggers.PrometheusStatLogger(_vllm_config("Qwen/Qwen3-0.6B"), list(range(engines)))
    rnd = random.Random(0)
    for attr in vars(logger).values():
        for metric in attr.values() if isinstance(attr, dict) else ():
            if isinstance(metric, (Counter, Gauge, Histogram)):
                _fill(metric, rnd)
    ours = CollectorRegistry()
    built = kvm.build({Counter: Counter, Gauge: Gauge, Histogram: Histogram}, ours, ("engine",))
    for spec in kvm.SPECS:
        for engine in range(engines):
            values = [LABELS.get(label, ("timeout", "ok"))[0] for label in spec.labels]
            _fill(built[spec.attr].labels(str(engine), *values), rnd)
    return generate_latest(REGISTRY).decode() + generate_latest(ours).decode()


def library(text: str) -> int:
    return sum(len(f.samples) for f in text_string_to_metric_families(text))


def ours(text: str) -> int:
    return sum(1 for _ in promtext.samples(text))


def cpu_ms(parse: Callable[[str], int], text: str) -> float:
    """Best of 3 rounds of CPU time per call, in ms."""
    runs = max(1, 2_000_000 // max(len(text), 1))
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        for _ in range(runs):
            parse(text)
        best = min(best, (time.process_time() - start) / runs)
    return best * 1000


def measure(text: str) -> dict[str, float]:
    mib = len(text.encode()) / (1 << 20)
    cut = metricstext.relevant(text, transfer.READ)
    row = {"bytes": len(text.encode()), "lines": text.count("\n"), "cut_lines": cut.count("\n")}
    for label, parse in (("library", library), ("promtext", ours)):
        row[f"{label}_ms"] = cpu_ms(parse, text)
        row[f"{label}_ms_per_mib"] = row[f"{label}_ms"] / mib
        row[f"{label}_cut_ms"] = cpu_ms(lambda t, p=parse: p(metricstext.relevant(t, transfer.READ)), text)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--write", type=Path, help="store the one-engine text here (the tests' fixture)")
    args = ap.parse_args()
    if args.write:
        args.write.write_text(vllm_text(1))
    for engines in args.engines:
        text = vllm_text(engines)
        assert library(text) == ours(text), "the parsers disagree on the sample count"
        print(json.dumps({"engines": engines, **{k: round(v, 3) for k, v in measure(text).items()}}))


if __name__ == "__main__":
    main()
