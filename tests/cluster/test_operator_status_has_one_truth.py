"""One status truth on the real API server: the operator's three status writers (reconcile and resync,
the refresh on workload events, the transfer-metrics timer) never undo each other's findings.

A watch records every stored version of the CR, so a condition that flips for one write and back at the
next is seen even if it lasted milliseconds. The operator runs as a process with a fast metrics timer
and resync; the engines' metrics come from a local server whose counters grow, so every tick writes.
"""

from __future__ import annotations

import urllib.request

import pytest
from kvferry.local.controlplane.processes import reserve_ports

from tests.cluster.engine_metrics import FakeMetrics, prometheus
from tests.cluster.status_log import StatusLog
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

TICKS = 5  # metric-timer status writes while the Secret is missing
RESYNCS = 2  # full reconciles in the same window
SECRET = "hf-token"


@pytest.fixture
def fast_operator(start_operator, fake_metrics):
    """The operator with a 0.5 s metrics timer and a 1.5 s resync; returns the port of its /metrics."""
    port = reserve_ports(1)[0]
    start_operator(
        "--metrics-interval",
        "0.5",
        "--resync-interval",
        "1.5",
        "--metrics-url",
        fake_metrics.url,
        env={"KVFERRY_METRICS_PORT": str(port)},
    )
    return port


def _resyncs(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("kvferry_operator_reconciles_total{") and 'trigger="resync"' in line
    )


def _healthy(cluster, name: str) -> bool:
    return cluster.condition(name, "TransferHealthy").get("status") == "True"


def _tick_and_resync(name: str, fake_metrics: FakeMetrics, log: StatusLog, port: int) -> None:
    """TICKS status writes by the metrics timer (more transfers each time, no failures) and RESYNCS
    full reconciles, all while the CR's faults stay as they are."""
    resyncs, base = _resyncs(port), max(log.transfers(name))
    for i in range(TICKS):
        count = base + 100 * (i + 1)
        fake_metrics.texts = {f"{name}-prefill-0": prometheus(count, 0), f"{name}-decode-0": ""}
        wait_until(lambda c=count: c in log.transfers(name), f"tick {i} ({count} transfers) written", 30)
    wait_until(lambda: _resyncs(port) >= resyncs + RESYNCS, f"{RESYNCS} resyncs", 30)


def test_ticks_and_resyncs_keep_secret_missing_until_the_secret_exists(
    cluster, fast_operator, fake_metrics, status_log
) -> None:
    fake_metrics.texts = {"sm-prefill-0": prometheus(1, 0), "sm-decode-0": ""}
    cluster.apply(make_inference("sm", accelerator="p5en", modelToken={"name": SECRET}).obj())
    wait_until(
        lambda: cluster.condition("sm", "TransferHealthy").get("status") == "True", "healthy transfers"
    )
    _tick_and_resync("sm", fake_metrics, status_log, fast_operator)
    # Healthy transfers on every tick, yet Degraded never left SecretMissing.
    assert status_log.runs("sm", "Degraded") == [("True", "SecretMissing")], status_log.runs("sm", "Degraded")
    assert f"secret {SECRET}" in cluster.condition("sm", "Degraded")["message"]

    cluster.core.create_namespaced_secret(
        cluster.ns, {"metadata": {"name": SECRET}, "stringData": {"token": "t"}}
    )
    wait_until(lambda: cluster.condition("sm", "Degraded").get("status") == "False", "Degraded cleared", 30)
    _tick_and_resync("sm", fake_metrics, status_log, fast_operator)
    assert status_log.runs("sm", "Degraded") == [("True", "SecretMissing"), ("False", "Reconciled")]
    assert status_log.flaps("sm") == {}, status_log.flaps("sm")


def test_a_conflict_outranks_a_missing_secret_for_every_writer(
    cluster, fast_operator, fake_metrics, status_log
) -> None:
    """InvalidSpec > ApplyFailed > Conflict > SecretMissing > TransferUnhealthy: with both a foreign
    object and a missing Secret, Degraded says Conflict whichever writer wrote last; once the foreign
    object is gone, the next fault in line shows."""
    cluster.core.create_namespaced_config_map(
        cluster.ns, {"metadata": {"name": "pc-config"}, "data": {"owner": "team-b"}}
    )
    fake_metrics.texts = {"pc-prefill-0": prometheus(1, 0), "pc-decode-0": ""}
    cluster.apply(make_inference("pc", accelerator="p5en", modelToken={"name": SECRET}).obj())
    wait_until(
        lambda: cluster.condition("pc", "TransferHealthy").get("status") == "True", "healthy transfers"
    )
    _tick_and_resync("pc", fake_metrics, status_log, fast_operator)
    assert status_log.runs("pc", "Degraded") == [("True", "Conflict")], status_log.runs("pc", "Degraded")
    assert "ConfigMap pc-config" in cluster.condition("pc", "Degraded")["message"]

    cluster.core.delete_namespaced_config_map("pc-config", cluster.ns)
    wait_until(
        lambda: cluster.condition("pc", "Degraded").get("reason") == "SecretMissing", "SecretMissing", 30
    )
    # The GET above can see the new status before the log's watch delivers it (CI saw that once).
    wait_until(
        lambda: status_log.runs("pc", "Degraded")[-1:] == [("True", "SecretMissing")], "its watch event", 30
    )
    assert status_log.runs("pc", "Degraded") == [("True", "Conflict"), ("True", "SecretMissing")]
    assert status_log.flaps("pc") == {}, status_log.flaps("pc")
