"""metrics: a worker's journal, shipped as KvferryStats and replayed by KvferryPromMetrics, yields the
same kvferry_ values on the API server's registry, with vLLM's labels in front."""

from __future__ import annotations

from types import SimpleNamespace

from kvferry.connector import metrics as M
from kvferry.connector.connector import KvferryConnector, KvferryStats
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


def test_journal_round_trip_to_prometheus():
    worker = M.Metrics(journal=True)
    worker.record("transfers", 1, "consumer")
    worker.record("failures", 1, "consumer", "deadline")
    worker.record("receive_wait", 0.02)
    worker.record("pending", 3, "consumer", "receives", "0")
    stats = KvferryStats(data={"journal": worker.take_journal()})
    other = KvferryConnector.build_kv_connector_stats({"journal": [["transfers", ["consumer"], 1]]})
    merged = stats.aggregate(other)
    assert merged.reduce() == {"transfers": 2, "failures": 1}
    assert not merged.is_empty() and worker.take_journal() == []

    registry = CollectorRegistry()

    def bind(cls):  # vLLM passes its own metric classes; here: prometheus_client's on a private registry
        return lambda **kw: cls(registry=registry, **kw)

    kinds = {Counter: bind(Counter), Histogram: bind(Histogram), Gauge: bind(Gauge)}
    prom = KvferryConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), kinds, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    prom.observe(merged.data, engine_idx=0)
    text = generate_latest(registry).decode()
    assert 'kvferry_transfers_total{engine="0",model_name="tiny",role="consumer"} 2.0' in text
    assert (
        'kvferry_transfer_failures_total{engine="0",model_name="tiny",reason="deadline",role="consumer"} 1.0'
        in text
    )
    assert 'kvferry_receive_wait_seconds_count{engine="0",model_name="tiny"} 1.0' in text
    assert (
        'kvferry_pending{engine="0",kind="receives",model_name="tiny",role="consumer",tp_rank="0"} 3.0'
        in text
    )
