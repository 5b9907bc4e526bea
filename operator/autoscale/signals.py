"""Autoscale signals: engines' Prometheus samples -> what the planner sees over one window (pure).

Engines export cumulative histograms, so a latency percentile over a window is computed from the
difference of two scrapes, pod by pod: a pod first seen in this scrape only sets its baseline, and a
pod whose counts went down (restarted) counts from zero. The input is parsed samples keyed by a
source name (a pod; or one router endpoint aggregating a pool), so either source can feed it.

Names are vLLM's own (vllm/v1/metrics/loggers.py). Inter-token latency is read on decode. TTFT is read
on both roles and the larger percentile counts: decode's first token includes its wait for KV only
from when decode's leg opened, and the router opens it when prefill is about to start the request
(router `push.decode_start: before-prefill`), so a request's time in prefill's queue shows only in
prefill's own TTFT (its one-token leg, sent on arrival). Each is a lower bound of what clients see.
Queues and KV usage per role. Prefill's busy fraction (vLLM's prefill-time histogram sum added over the
window, per second of the window, per pod): TTFT says nothing about how much headroom a scale-in
leaves, so the planner needs the load too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvferry.contracts import promtext
from kvferry.operator.status import metricstext
from kvferry.operator.status.transfer import quantile

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
WAITING = "vllm:num_requests_waiting"
# Waiting split by reason (vLLM >= 0.30): "capacity" is the engine's own queue; "deferred" includes a
# decode request waiting for its KV from prefill, which is prefill's delay, not decode's.
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
# Seconds each request spent in its prefill phase. On a prefill engine (one-token legs) the added sum
# over a window, per second, is how busy it was (requests prefilled in the same step each count the
# step: an overestimate, which only makes a scale-in more cautious).
PREFILL_TIME = "vllm:request_prefill_time_seconds"
QUANTILES = {"p50": 0.5, "p90": 0.9}
# Fewer finished requests than this in a window say nothing about a percentile: the planner holds.
MIN_REQUESTS = 3

Buckets = dict[float, float]  # le -> cumulative count
# The families parse_engine reads (metricstext.relevant keeps only these before parsing).
READ = (TTFT, ITL, "vllm:num_requests_", KV_USAGE, PREFILL_TIME)


@dataclass(frozen=True)
class EngineSample:
    """One engine's cumulative latency buckets and current gauges (summed over its label sets)."""

    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    prefill_s: float | None = None  # cumulative PREFILL_TIME sum; None: the engine does not export it


def _add(buckets: Buckets, le: str, value: float) -> None:
    bound = float(le)
    buckets[bound] = buckets.get(bound, 0.0) + value


def parse_engine(text: str) -> EngineSample:
    """One engine's /metrics text. Raises ValueError on text that is not Prometheus exposition."""
    ttft: Buckets = {}
    itl: Buckets = {}
    gauges = {WAITING: 0.0, RUNNING: 0.0, KV_USAGE: 0.0}
    capacity: float | None = None  # waiting for scheduling capacity, where the engine says so
    prefill_s: float | None = None
    for s in promtext.samples(metricstext.relevant(text, READ)):
        if s.name == WAITING_BY_REASON:
            if s.labels.get("reason") == "capacity":
                capacity = (capacity or 0.0) + s.value
        elif s.name == TTFT + "_bucket":
            _add(ttft, s.labels["le"], s.value)
        elif s.name == ITL + "_bucket":
            _add(itl, s.labels["le"], s.value)
        elif s.name == PREFILL_TIME + "_sum":
            prefill_s = (prefill_s or 0.0) + s.value
        elif s.name == KV_USAGE:
            gauges[KV_USAGE] = max(gauges[KV_USAGE], s.value)  # engines report it per engine index
        elif s.name in gauges:
            gauges[s.name] += s.value
    waiting = gauges[WAITING] if capacity is None else capacity
    return EngineSample(ttft, itl, waiting, gauges[RUNNING], gauges[KV_USAGE], prefill_s)


def increase(now: Buckets, before: Buckets | None) -> Buckets:
    """Bucket counts added since `before`; a reset (any count lower than before) counts from zero."""
    if before is None:
        return {}
    if any(now.get(le, 0.0) < count for le, count in before.items()):
        return dict(now)
    return {le: count - before.get(le, 0.0) for le, count in now.items()}


def _sum(parts: Iterable[Buckets]) -> Buckets:
    total: Buckets = {}
    for part in parts:
        for le, count in part.items():
            total[le] = total.get(le, 0.0) + count
    return total


def _count(buckets: Buckets) -> int:
    return int(max(buckets.values(), default=0.0))  # the +Inf bucket holds every observation


@dataclass(frozen=True)
class Window:
    """What the planner sees for one evaluation: latencies over the window, queues and pods now."""

    ttft: float | None = None  # seconds at the spec's percentile, the larger role's; None: too few requests
    itl: float | None = None
    requests: int = 0  # first tokens observed on decode in the window
    tokens: int = 0  # inter-token intervals observed in the window
    prefill_waiting: float = 0.0
    decode_waiting: float = 0.0
    prefill_running: float = 0.0
    decode_running: float = 0.0
    decode_kv_usage: float = 0.0  # the fullest decode's KV cache, 0..1
    prefill_sources: int = 0  # engines that answered
    decode_sources: int = 0
    compared: int = 0  # decode engines seen in both scrapes: 0 = no window yet, latency unknown
    prefill_busy: float | None = None  # mean busy fraction of the prefill engines; None: unknown
    prefill_ttft: float | None = None  # prefill's own percentile (its queue and compute); None: too few


Scrape = Mapping[str, Mapping[str, EngineSample]]  # role -> source (pod) -> sample


def busy(
    before: Mapping[str, EngineSample], now: Mapping[str, EngineSample], elapsed_s: float
) -> float | None:
    """Mean busy fraction of the engines seen in both scrapes that export their prefill time; a
    restarted engine (its sum went down) counts from zero. None when no engine can say."""
    if elapsed_s <= 0:
        return None
    parts = []
    for source, sample in now.items():
        old = before.get(source)
        if sample.prefill_s is None or old is None or old.prefill_s is None:
            continue
        added = sample.prefill_s - old.prefill_s
        parts.append((sample.prefill_s if added < 0 else added) / elapsed_s)
    return sum(parts) / len(parts) if parts else None


def window(before: Scrape, now: Scrape, percentile: str, elapsed_s: float = 0.0) -> Window:
    """The planner's view between two scrapes `elapsed_s` apart; `before` empty (first scrape) gives
    queues only."""
    q = QUANTILES[percentile]
    prefill, decode = now.get("prefill", {}), now.get("decode", {})
    old, old_prefill = before.get("decode", {}), before.get("prefill", {})
    ttft = _sum(increase(s.ttft, old[p].ttft if p in old else None) for p, s in decode.items())
    itl = _sum(increase(s.itl, old[p].itl if p in old else None) for p, s in decode.items())
    queued = _sum(
        increase(s.ttft, old_prefill[p].ttft if p in old_prefill else None) for p, s in prefill.items()
    )
    requests, tokens = _count(ttft), _count(itl)
    seen = [v for b in (ttft, queued) if _count(b) >= MIN_REQUESTS and (v := quantile(b, q)) is not None]
    own = quantile(queued, q) if _count(queued) >= MIN_REQUESTS else None
    return Window(
        ttft=max(seen) if requests >= MIN_REQUESTS and seen else None,
        itl=quantile(itl, q) if tokens >= MIN_REQUESTS else None,
        requests=requests,
        tokens=tokens,
        prefill_waiting=sum(s.waiting for s in prefill.values()),
        decode_waiting=sum(s.waiting for s in decode.values()),
        prefill_running=sum(s.running for s in prefill.values()),
        decode_running=sum(s.running for s in decode.values()),
        decode_kv_usage=max((s.kv_usage for s in decode.values()), default=0.0),
        prefill_sources=len(prefill),
        decode_sources=len(decode),
        compared=sum(1 for p in decode if p in old),
        prefill_busy=busy(old_prefill, prefill, elapsed_s),
        prefill_ttft=own,
    )
