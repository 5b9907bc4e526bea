"""The autoscale control loop on the real API server: the real operator (under its own RBAC) reads engine
metrics in vLLM's names from a real HTTP server on 127.0.0.1, plans, and scales prefill out and back in
through the StatefulSet's /scale subresource, with events, status and the wide printer columns.

The engines are stand-ins: each fetch of a decode pod's /metrics reports 10 more finished requests at
the latency the test sets, as a busy vLLM's cumulative histograms would; kwok runs the pods."""

from __future__ import annotations

import threading

import pytest

from tests.cluster.engine_metrics import FakeMetrics
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
WAITING = "vllm:num_requests_waiting"
TTFT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.1)


PER_FETCH = 10  # requests a decode pod reports finished between two reads of its /metrics


def histogram(name: str, bounds: tuple[float, ...], values: list[float]) -> list[str]:
    """Cumulative buckets of PER_FETCH observations at each value (one value per earlier fetch)."""
    lines = [f"# TYPE {name} histogram"]
    for le in bounds:
        lines.append(f'{name}_bucket{{le="{le}"}} {PER_FETCH * sum(v <= le for v in values)}')
    n = PER_FETCH * len(values)
    return [
        *lines,
        f'{name}_bucket{{le="+Inf"}} {n}',
        f"{name}_count {n}",
        f"{name}_sum {PER_FETCH * sum(values)}",
    ]


class Engines:
    """Per pod Prometheus text: prefill pods report a queue, decode pods PER_FETCH more finished requests
    per read, at the TTFT and ITL the test sets."""

    def __init__(self) -> None:
        self.ttft, self.itl, self.prefill_waiting = 0.05, 0.02, 0  # quiet until the test loads it
        self.fetches: dict[str, list[tuple[float, float]]] = {}
        self.lock = threading.Lock()

    def get(self, pod: str) -> str | None:
        if "-prefill-" in pod:
            return f"# TYPE {WAITING} gauge\n{WAITING} {self.prefill_waiting}\n"
        if "-decode-" not in pod:
            return None
        with self.lock:
            seen = self.fetches.setdefault(pod, [])
            seen.append((self.ttft, self.itl))
            ttfts, itls = [t for t, _ in seen], [i for _, i in seen]
        lines = [f"# TYPE {WAITING} gauge", f"{WAITING} 0"]
        lines += histogram(TTFT, TTFT_BUCKETS, ttfts) + histogram(ITL, ITL_BUCKETS, itls)
        return "\n".join(lines) + "\n"


@pytest.fixture
def engines(fake_metrics: FakeMetrics) -> Engines:
    e = Engines()
    fake_metrics.texts = e  # type: ignore[assignment]  # FakeMetrics only calls .get(pod)
    return e


def test_latency_scales_prefill_out_and_back_in_through_scale(
    cluster, start_operator, fake_metrics, engines
) -> None:
    start_operator("--metrics-interval", "1", "--metrics-url", fake_metrics.url)
    cr = (
        make_inference("as", accelerator="p5en")
        .prefill(replicasOwner="autoscaler")
        .decode(replicasOwner="autoscaler")
        .set(
            autoscaling={
                "ttftSeconds": 1.0,
                "itlSeconds": 0.05,
                "prefill": {"minReplicas": 1, "maxReplicas": 2},
                "decode": {"minReplicas": 1, "maxReplicas": 2},
                "scaleDownStabilizationSeconds": 3,
            }
        )
        .obj()
    )
    cluster.apply(cr)
    cluster.wait_ready("as", "CR as Ready")
    engines.ttft, engines.prefill_waiting = 3.0, 5

    def replicas(role: str) -> int:
        return (cluster.get("StatefulSet", f"as-{role}") or {}).get("spec", {}).get("replicas", 0)

    # TTFT p90 3 s against 1 s, requests queued on prefill: prefill grows (at most to its max 2).
    wait_until(lambda: replicas("prefill") == 2, "prefill scaled out to 2 through /scale")

    def autoscaling() -> dict:
        return cluster.cr("as").get("status", {}).get("autoscaling") or {}

    # The scale is written before the status of the same evaluation.
    wait_until(lambda: "prefill 1->2" in autoscaling().get("lastDecision", ""), "the decision in status")
    status = autoscaling()
    assert status["targets"] == "TTFT p90 1.00s, ITL p90 50ms"
    assert status.get("ttftSeconds", 0) > 1.0 and status["prefillWaiting"] == 5, status
    assert "TTFT p90" in status["lastDecision"], status
    assert replicas("decode") == 1  # ITL 20 ms is within its target
    up = cluster.events("ScaledUp")
    assert up and "prefill 1 -> 2: TTFT p90" in up[0]["message"], up

    wide = cluster.kubectl("get", "disaggregatedinferences", "as", "-o", "wide").stdout
    header = wide.splitlines()[0].split()
    assert {"LATENCY", "AUTOSCALE", "SCALE-REASON"} <= set(header), wide

    # Load gone: fast first tokens, no queue. After the 3 s window of down votes prefill shrinks by one.
    engines.ttft, engines.prefill_waiting = 0.05, 0
    wait_until(lambda: replicas("prefill") == 1, "prefill scaled back in to 1")
    down = cluster.events("ScaledDown")
    assert down and "prefill 2 -> 1" in down[0]["message"], down
    wait_until(lambda: "prefill 2->1" in autoscaling().get("lastDecision", ""), "scale-in in status")
    assert "below 50% of target" in autoscaling()["lastDecision"]
    assert autoscaling()["decode"]["desired"] == 1
    assert replicas("decode") == 1  # held at its minimum throughout
