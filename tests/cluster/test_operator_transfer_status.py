"""Transfer health in status and `kubectl get`, fed by a real HTTP server on 127.0.0.1 serving Prometheus
text per pod (the operator's metrics URL template points at it through the CR annotation)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kvferry.operator import names

from tests.cluster.operator_fixtures import *  # noqa: F403
from tests.cluster.operator_fixtures import wait_until
from tests.unit.operator.cases import make_inference


def prometheus(transfers: int, failures: int, backend: str = "LIBFABRIC") -> str:
    buckets = [(0.01, transfers // 10), (0.05, transfers * 9 // 10), (0.1, transfers)]
    lines = [
        "# TYPE kvferry_transfers counter",
        f'kvferry_transfers_total{{backend="{backend}"}} {transfers}',
        "# TYPE kvferry_transfer_failures counter",
        f'kvferry_transfer_failures_total{{reason="deadline"}} {failures}',
        "# TYPE kvferry_transfer_seconds histogram",
    ]
    lines += [f'kvferry_transfer_seconds_bucket{{le="{le}"}} {n}' for le, n in buckets]
    lines += [
        f'kvferry_transfer_seconds_bucket{{le="+Inf"}} {transfers}',
        f"kvferry_transfer_seconds_count {transfers}",
        "kvferry_transfer_seconds_sum 3.0",
    ]
    return "\n".join(lines) + "\n"


class FakeMetrics:
    """Serves /<namespace>/<pod> -> the text set for that pod (404 otherwise)."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                text = outer.texts.get(self.path.rsplit("/", 1)[-1])
                self.send_response(200 if text is not None else 404)
                self.end_headers()
                self.wfile.write((text or "").encode())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}" + "/{namespace}/{pod}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_metrics() -> Iterator[FakeMetrics]:
    server = FakeMetrics()
    yield server
    server.close()


def _with_metrics(builder, url: str) -> dict:
    obj = builder.obj()
    obj["metadata"]["annotations"] = {names.ANNOTATION_METRICS_URL: url}
    return obj


def test_kubectl_get_shows_transfer_columns_and_health(cluster, operator, fake_metrics) -> None:
    fake_metrics.texts = {"m-prefill-0": prometheus(300, 2), "m-decode-0": ""}
    cluster.apply(_with_metrics(make_inference("m", accelerator="p5en"), fake_metrics.url))
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
        "AGE",
    ]
    cols = row.split()
    assert cols[:7] == ["m", "push", "1/1", "1/1", "True", "300", "2"], row
    assert cols[7].endswith("ms"), row
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
    cluster.apply(_with_metrics(make_inference("u", accelerator="p5en"), fake_metrics.url))
    wait_until(lambda: cluster.condition("u", "TransferHealthy").get("reason") == "UCXOnEFA", "UCXOnEFA")
    assert cluster.cr("u")["status"]["transfer"]["backend"] == "UCX"
