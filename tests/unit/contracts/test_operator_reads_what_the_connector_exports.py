"""Metrics and termination messages as written by the connector (and `kvferry inject`) are what the
operator reads: the connector's own registry and preflight checks, parsed by the operator's status code."""

from __future__ import annotations

from pathlib import Path

from kvferry.connector.metrics import Metrics
from kvferry.connector.preflight import backend_checks, efa_checks, failure_message, record
from kvferry.contracts import labels, termination
from kvferry.contracts import metrics as m
from kvferry.operator.status import podchecks
from kvferry.operator.status import transfer as tm
from kvferry.operator.status.conditions import Reason
from prometheus_client import generate_latest


def exported(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def fake_efa_host(root: Path) -> Path:
    """A /sys/class/infiniband with one device bound to the efa driver."""
    (root / "drivers" / "efa").mkdir(parents=True)
    (root / "ib" / "efa0" / "device").mkdir(parents=True)
    (root / "ib" / "efa0" / "device" / "driver").symlink_to(root / "drivers" / "efa")
    return root / "ib"


def test_transfers_failures_backends_and_times_reach_the_operator() -> None:
    metrics = Metrics()
    metrics.record("transfers", 3, "producer")
    metrics.record("failures", 2, "producer", m.LAYOUT_MISMATCH)
    metrics.record("failures", 1, "producer", "deadline")
    metrics.record("bytes", 4096, "producer", "LIBFABRIC")
    for seconds in (0.004, 0.004, 0.04):
        metrics.record("match_to_done", seconds)
    sample = tm.parse(exported(metrics))
    assert (sample.transfers, sample.failures, sample.backends) == (3, 3, {"LIBFABRIC"})
    assert sample.failures_by_reason == {m.LAYOUT_MISMATCH: 2, "deadline": 1}
    assert tm.layout_refusals(sample, tm.Sample()) == 2
    assert sum(sample.buckets.values()) > 0 and tm.quantile(sample.buckets, 0.5) <= 0.005


def test_preflight_checks_reach_the_operator(tmp_path: Path) -> None:
    metrics = Metrics()
    record(backend_checks(["UCX"], ["UCX"]) + efa_checks(["UCX"], fake_efa_host(tmp_path)), metrics)
    sample = tm.parse(exported(metrics))
    assert sample.backends == {"UCX"} and sample.ucx_on_efa and not sample.failed_checks

    missing = Metrics()
    record(backend_checks([], ["LIBFABRIC"]), missing)
    assert tm.parse(exported(missing)).failed_checks == {m.CHECK_BACKEND + "LIBFABRIC"}


def _stopped_pod(container: str, message: str, init: bool = False) -> dict:
    status = {"name": container, "state": {"terminated": {"exitCode": 1, "message": message}}}
    key = "initContainerStatuses" if init else "containerStatuses"
    return {
        "metadata": {"name": "m-decode-0", "labels": {labels.ROLE: "decode"}},
        "status": {key: [status]},
    }


def test_termination_messages_reach_the_operator() -> None:
    preflight = failure_message(backend_checks([], ["LIBFABRIC"]))
    reason, message = podchecks.start_failure([_stopped_pod("vllm", preflight)])
    assert reason == Reason.PREFLIGHT_FAILED and "backend_LIBFABRIC: plugin LIBFABRIC not created" in message
    inject = termination.INJECT_FAILED + "No space left on device"
    reason, _ = podchecks.start_failure([_stopped_pod("kvferry-inject", inject, init=True)])
    assert reason == Reason.INJECT_FAILED
