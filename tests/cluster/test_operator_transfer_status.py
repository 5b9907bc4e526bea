"""Transfer health in status and `kubectl get`, fed by a real HTTP server on 127.0.0.1 serving Prometheus
text per pod (the operator's own --metrics-url template points at it). A CR cannot move that URL."""

from __future__ import annotations

import pytest

from tests.cluster.engine_metrics import FakeMetrics, prometheus
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until


@pytest.fixture
def operator(start_operator, fake_metrics):
    """The operator reading engine metrics from `fake_metrics` (its own setting, not the CR's)."""
    return start_operator("--metrics-interval", "1", "--metrics-url", fake_metrics.url)


def _prefix_cache(queries: int, hits: int) -> str:
    """vLLM's prefix-cache counters (prompt tokens looked up, found), as an engine exports them."""
    return (
        "# TYPE vllm:prefix_cache_queries counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
    )


def test_kubectl_get_shows_transfer_columns_and_health(cluster, operator, fake_metrics) -> None:
    fake_metrics.texts = {
        "m-prefill-0": prometheus(300, 2) + _prefix_cache(1000, 300),
        "m-decode-0": _prefix_cache(1000, 500),
    }
    cluster.apply(make_inference("m", accelerator="p5en").obj())
    cluster.wait_ready("m", "CR m Ready")
    wait_until(
        lambda: cluster.cr("m")["status"].get("transfer", {}).get("transfers") == 300, "transfer summary"
    )
    out = cluster.kubectl("get", "disaggregatedinferences").stdout
    header, row = out.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "MODE",
        "PREFILL",
        "DECODE",
        "READY",
        "TRANSFERS",
        "FAILED",
        "XFER-P50",
        "PREFIX-HIT",
        "AGE",
    ]
    cols = row.split()
    assert cols[:7] == ["m", "push", "1/1", "1/1", "True", "300", "2"], row
    assert cols[7].endswith("ms"), row
    assert cols[8] == "40%", row  # 800 of 2,000 prompt tokens found in the two prefix caches
    health = cluster.condition("m", "TransferHealthy")
    # 2 failures seen on the first scrape count as new failures.
    assert (health["status"], health["reason"]) == ("False", "TransferFailures")

    fake_metrics.texts["m-prefill-0"] = prometheus(400, 2)  # no new failures: healthy again
    wait_until(
        lambda: cluster.condition("m", "TransferHealthy").get("status") == "True", "TransferHealthy=True"
    )
    assert cluster.condition("m", "Degraded")["status"] == "False"
    fake_metrics.texts["m-prefill-0"] = prometheus(500, 7)
    wait_until(
        lambda: cluster.condition("m", "TransferHealthy").get("reason") == "TransferFailures", "failures"
    )
    transfer = cluster.cr("m")["status"]["transfer"]
    assert (transfer["failures"], transfer["lastFailure"]) == (7, "deadline") and transfer["lastFailureTime"]
    assert cluster.condition("m", "Degraded")["reason"] == "TransferUnhealthy"
    assert cluster.events("TransferHealthChanged")


def test_ucx_on_an_efa_preset_is_reported(cluster, operator, fake_metrics) -> None:
    fake_metrics.texts = {"u-prefill-0": prometheus(10, 0, backend="UCX")}
    cluster.apply(make_inference("u", accelerator="p5en").obj())
    wait_until(lambda: cluster.condition("u", "TransferHealthy").get("reason") == "UCXOnEFA", "UCXOnEFA")
    assert cluster.cr("u")["status"]["transfer"]["backend"] == "UCX"


def test_a_cr_cannot_choose_what_the_operator_fetches(cluster, operator, fake_metrics) -> None:
    """The old kvferry.io/metrics-url annotation (an SSRF, and a format spec that allocated at will)
    is ignored: the canary on 127.0.0.1 is never contacted and the operator stays up."""
    canary = FakeMetrics()
    try:
        fake_metrics.texts = {"c-prefill-0": prometheus(5, 0), "c-decode-0": prometheus(0, 0)}
        hostile = {
            "c": canary.url,  # cloud metadata or an internal service, in real life
            "huge": f"http://127.0.0.1:{canary.server.server_port}/{{pod:>70000000}}",
        }
        for name, url in hostile.items():
            cr = make_inference(name).obj()
            cr["metadata"]["annotations"] = {"kvferry.io/metrics-url": url}
            cluster.apply(cr)
        wait_until(
            lambda: cluster.cr("c").get("status", {}).get("transfer", {}).get("transfers") == 5,
            "metrics read from the operator's own URL",
        )
        wait_until(lambda: sum("huge-prefill-0" in h for h in fake_metrics.hits) >= 2, "two scrapes of huge")
        assert canary.hits == [], canary.hits
        assert operator.proc.poll() is None, operator.text()[-2000:]
    finally:
        canary.close()
