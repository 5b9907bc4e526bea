"""Self-metrics step: the operator's own Prometheus metrics (API requests, reconciles, their duration).

Served on KVFERRY_METRICS_PORT when set (the chart's metrics Service scrapes it); benchmarks read
`kvferry_operator_api_requests_total` / `kvferry_operator_reconciles_total` for requests per reconcile.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()
API_REQUESTS = Counter(
    "kvferry_operator_api_requests",
    "Kubernetes API requests made by the operator's client",
    ["verb", "kind", "code"],
    registry=REGISTRY,
)
RECONCILES = Counter(
    "kvferry_operator_reconciles",
    "Reconciles by trigger and result",
    ["trigger", "result"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "kvferry_operator_reconcile_seconds", "Wall time of one reconcile (apply + status)", registry=REGISTRY
)
SCRAPES = Counter(
    "kvferry_operator_metric_scrapes", "Transfer-metric scrapes of engine pods", ["result"], registry=REGISTRY
)


AUTOSCALE_DESIRED = Gauge(
    "kvferry_autoscale_desired_replicas",
    "Replicas the autoscale planner wants for a role (spec.autoscaling); an HPA or KEDA may act on it",
    ["namespace", "name", "role"],
    registry=REGISTRY,
)


def record_request(verb: str, kind: str, code: int) -> None:
    API_REQUESTS.labels(verb, kind, str(code)).inc()


def serve(port: int, host: str) -> None:
    """Expose /metrics on host:port (a daemon thread; it ends with the process)."""
    start_http_server(port, addr=host, registry=REGISTRY)
