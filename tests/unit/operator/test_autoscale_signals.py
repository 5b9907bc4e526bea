"""Autoscale signals: engines' Prometheus text (vLLM's names and buckets) -> the planner's window."""

from __future__ import annotations

import pytest
from kvferry.operator.autoscale.signals import (
    ITL,
    KV_USAGE,
    RUNNING,
    TTFT,
    WAITING,
    WAITING_BY_REASON,
    parse_engine,
    window,
)
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

# vLLM 0.x buckets (vllm/v1/metrics/loggers.py), enough of them to place the values below.
TTFT_BUCKETS = (0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
LABELS = ["model_name", "engine"]


class Engine:
    """One vLLM engine's metrics, exported by prometheus_client as vLLM does."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(TTFT, "ttft", LABELS, buckets=TTFT_BUCKETS, registry=r).labels("m", "0")
        self.itl = Histogram(ITL, "itl", LABELS, buckets=ITL_BUCKETS, registry=r).labels("m", "0")
        self.waiting = Gauge(WAITING, "waiting", LABELS, registry=r).labels("m", "0")
        self.running = Gauge(RUNNING, "running", LABELS, registry=r).labels("m", "0")
        self.kv = Gauge(KV_USAGE, "kv", LABELS, registry=r).labels("m", "0")

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def scrape(**pods: Engine) -> dict:
    return {"decode": {name: parse_engine(e.text()) for name, e in pods.items()}}


def test_first_scrape_sets_the_baseline_only() -> None:
    d = Engine()
    for _ in range(10):
        d.ttft.observe(3.0)
    d.waiting.set(4)
    w = window({}, scrape(d0=d), "p90")
    assert w.ttft is None and w.requests == 0
    assert w.decode_waiting == 4 and w.decode_sources == 1 and w.compared == 0


def test_percentile_over_the_window_is_what_the_engines_observed() -> None:
    d = Engine()
    for _ in range(50):
        d.ttft.observe(0.03)  # before the window: fast
    before = scrape(d0=d)
    for _ in range(20):
        d.ttft.observe(3.0)  # in the window: slow, in the (2.5, 5] bucket
    for _ in range(30):
        d.itl.observe(0.06)  # (0.05, 0.075]
    w = window(before, scrape(d0=d), "p90")
    assert w.requests == 20 and w.tokens == 30 and w.compared == 1
    assert w.ttft is not None and 2.5 < w.ttft <= 5.0  # the earlier fast ones do not count
    assert w.itl is not None and 0.05 < w.itl <= 0.075
    p50 = window(before, scrape(d0=d), "p50")
    assert p50.ttft is not None and p50.ttft < w.ttft


def test_pods_are_summed_and_the_fullest_kv_cache_counts() -> None:
    a, b = Engine(), Engine()
    before = scrape(a=a, b=b)
    for _ in range(9):
        a.ttft.observe(0.05)
    b.ttft.observe(0.9)
    a.kv.set(0.3)
    b.kv.set(0.96)
    a.running.set(2)
    b.running.set(5)
    w = window(before, scrape(a=a, b=b), "p90")
    assert w.requests == 10
    assert w.ttft is not None and w.ttft <= 0.1  # 9 of 10 fast: p90 in the fast bucket
    assert w.decode_kv_usage == pytest.approx(0.96) and w.decode_running == 7


def test_decode_requests_waiting_for_kv_are_not_decode_s_queue() -> None:
    """vLLM splits waiting by reason; a decode request deferred while its KV arrives from prefill is
    prefill's delay (seen on the real stack: blaming decode scaled the wrong role). Without the split,
    every waiting request counts."""
    e = Engine()
    e.waiting.set(4)
    assert parse_engine(e.text()).waiting == 4
    by_reason = Gauge(WAITING_BY_REASON, "w", [*LABELS, "reason"], registry=e.registry)
    by_reason.labels("m", "0", "capacity").set(1)
    by_reason.labels("m", "0", "deferred").set(3)
    assert parse_engine(e.text()).waiting == 1


def test_a_restarted_pod_counts_from_zero_and_a_new_one_from_its_first_scrape() -> None:
    old, new = Engine(), Engine()
    for _ in range(100):
        old.ttft.observe(0.03)
    before = scrape(p=old)
    restarted = Engine()
    for _ in range(5):
        restarted.ttft.observe(6.0)
    for _ in range(40):
        new.ttft.observe(9.0)  # appeared since the last scrape: baseline only
    w = window(before, scrape(p=restarted, q=new), "p90")
    assert w.requests == 5 and w.ttft is not None and 5.0 < w.ttft <= 7.5


def test_too_few_requests_give_no_percentile() -> None:
    d = Engine()
    before = scrape(d0=d)
    d.ttft.observe(9.0)
    d.ttft.observe(9.0)
    w = window(before, scrape(d0=d), "p90")
    assert w.requests == 2 and w.ttft is None


def test_text_that_is_not_metrics_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_engine("<html>not metrics</html>\n{")


def test_time_in_prefill_s_queue_counts_where_decode_does_not_see_it() -> None:
    """Decode's leg opens when prefill is about to start the request, so its TTFT misses prefill's
    queue; prefill's own TTFT (its one-token leg, sent on arrival) holds it, and the larger counts."""
    p, d = Engine(), Engine()
    before = {"prefill": {"p0": parse_engine(p.text())}, **scrape(d0=d)}
    for _ in range(20):
        d.ttft.observe(0.05)  # decode: the KV came soon after its leg opened
        p.ttft.observe(3.0)  # prefill: the requests waited in its queue
    w = window(before, {"prefill": {"p0": parse_engine(p.text())}, **scrape(d0=d)}, "p50")
    assert w.ttft is not None and 2.5 < w.ttft <= 5.0
    assert w.prefill_ttft == w.ttft  # prefill's own percentile, kept apart for the blame
    quiet = window(before, {"prefill": {"p0": parse_engine(Engine().text())}, **scrape(d0=d)}, "p50")
    assert quiet.ttft is not None and quiet.ttft <= 0.06  # a restarted, idle prefill adds nothing


def test_prefill_busy_is_its_prefill_time_per_second_of_the_window() -> None:
    def engine(prefill_s: float) -> str:
        return (
            "# TYPE vllm:request_prefill_time_seconds histogram\n"
            f'vllm:request_prefill_time_seconds_bucket{{le="+Inf",engine="0"}} 10\n'
            f'vllm:request_prefill_time_seconds_count{{engine="0"}} 10\n'
            f'vllm:request_prefill_time_seconds_sum{{engine="0"}} {prefill_s}\n'
        )

    before = {"prefill": {"a": parse_engine(engine(4.0)), "b": parse_engine(engine(100.0))}}
    # a: 6 s of prefill in 15 s; b restarted (its sum went down): 3 s since its start
    now = {
        "prefill": {
            "a": parse_engine(engine(10.0)),
            "b": parse_engine(engine(3.0)),
            "c": parse_engine(engine(9.0)),
        }
    }
    w = window(before, now, "p50", elapsed_s=15.0)
    assert w.prefill_busy == pytest.approx((6 / 15 + 3 / 15) / 2)  # c: first seen, baseline only
    assert window(before, now, "p50").prefill_busy is None  # no elapsed time: unknown
    no_export = {"prefill": {"a": parse_engine("vllm:num_requests_running 1\n")}}
    assert window(no_export, no_export, "p50", elapsed_s=15.0).prefill_busy is None
