"""operator_bench's table: the floor (no operator) beside the operator's designs, per-CR memory."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_bench = Path(__file__).parents[3] / "bench"
sys.path.append(str(_bench))  # operator_bench imports its sibling operator_bench_report, as a script run
_spec = importlib.util.spec_from_file_location("operator_bench", _bench / "operator_bench.py")
assert _spec is not None and _spec.loader is not None
operator_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(operator_bench)

CPU = {"kube-apiserver": 220.0, "kube-controller-manager": 167.0, "client": 33.0}
FLOOR = {"design": "floor", "crs": 10, "created_s": 1.0, "objects_s": 5.0, "ready_s": None}
FLOOR |= {"ready_count": 3, "requests": 140, "peak_rss_mib": 90.0, "cpu_s": CPU, "workloads_ready": 3}
AFTER = {"design": "after", "crs": 10, "apply_s": 2.0, "objects_s": None, "ready_s": 9.0, "ready_count": 10}
AFTER |= {"objects": 120, "objects_want": 140, "workloads_ready": 10}
AFTER |= {"requests": 150.0, "full_reconciles": 10.0, "peak_rss_mib": 110.0, "idle_rss_mib": 100.0}
AFTER |= {"cpu_s": CPU, "lag_s": 3.0, "by_trigger": {"create": 10.0}}


def rows(results: list[dict]) -> dict[str, list[str]]:
    lines = operator_bench.table(results).splitlines()[2:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in lines)}


def test_the_floor_shows_its_figures_and_a_dash_where_only_an_operator_has_one() -> None:
    table = rows([FLOOR, AFTER])
    assert table["all CRs created (8 clients)"] == ["1.0 s", "2.0 s"]
    assert table["all CRs Ready (from the first create)"] == ["not reached (3/10)", "9.0 s (10/10)"]
    assert table["API requests per CR"] == ["14.0", "15.0"]
    assert table["CRs with all workloads ready, then"] == ["3/10", "10/10"]
    assert table["full reconciles per CR"] == ["—", "1.00"]
    assert table["operator memory per CR (peak − idle; shards: sums)"] == ["—", "1.00 MiB"]
    assert table["CPU s to all Ready: API server"] == ["220 s", "220 s"]


def test_a_failed_design_leaves_the_others_figures() -> None:
    table = rows([{"design": "floor (failed)", "crs": 10}, AFTER])
    assert table["all objects present (from the first create)"] == ["—", "not reached (120/140)"]


def test_two_shards_show_each_replicas_peak_and_the_sums() -> None:
    sharded = AFTER | {"design": "after, 2 shards", "peak_rss_each": [70.0, 80.0], "peak_rss_mib": 150.0}
    sharded |= {"idle_rss_mib": 140.0, "cpu_s": CPU | {"client": 50.0}}
    table = rows([AFTER | {"peak_rss_each": [110.0]}, sharded])
    assert table["peak memory of each replica"] == ["110 MiB", "70 MiB / 80 MiB"]
    assert table["peak memory (operator; floor: its client; shards: sum)"] == ["110 MiB", "150 MiB"]
    assert table["operator memory per CR (peak − idle; shards: sums)"] == ["1.00 MiB", "1.00 MiB"]
    assert table["CPU s to all Ready: operator (floor: client)"] == ["33 s", "50 s"]


def test_summed_adds_every_replicas_requests_and_reconciles(monkeypatch) -> None:
    scraped = {
        1: {
            'kvferry_operator_api_requests_total{verb="get"}': 5.0,
            'kvferry_operator_reconciles_total{trigger="create",result="ok"}': 3.0,
        },
        2: {
            'kvferry_operator_api_requests_total{verb="get"}': 7.0,
            'kvferry_operator_reconciles_total{trigger="create",result="ok"}': 4.0,
            'kvferry_operator_reconciles_total{trigger="resync",result="ok"}': 1.0,
        },
    }
    monkeypatch.setattr(operator_bench, "operator_metrics", scraped.__getitem__)
    assert operator_bench.summed([1, 2]) == (12.0, {"create": 7.0, "resync": 1.0})
