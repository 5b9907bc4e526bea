"""pd_compare's summary: overhead against both single baselines and the kvferry / push ratios."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvferry.tools.loadbench import Cell

_spec = importlib.util.spec_from_file_location(
    "pd_compare", Path(__file__).parents[3] / "bench" / "pd_compare.py"
)
assert _spec is not None and _spec.loader is not None
pd_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pd_compare)


def cell(ttft: float, tpot: float = 5.0) -> list[Cell]:
    return [Cell(256, 1.0, 10, 0, ttft_ms={"p50": ttft}, tpot_ms={"p50": tpot})]


def test_overheads_and_ratios_against_both_baselines() -> None:
    results = {
        "single": cell(30.0), "single-1core": cell(40.0), "vllm-push": cell(80.0, 4.0),
        "kvferry": cell(60.0, 2.0),
    }  # fmt: skip
    table = pd_compare.comparison(results)
    head, _, row = table.splitlines()[:3]
    assert "overhead vs single kvferry/push" in head and "overhead vs single-1core kvferry/push" in head
    # vs single: push +50, kvferry +30 -> 0.60; vs one core: +40, +20 -> 0.50; TTFT 0.75, TPOT 0.50.
    assert row == (
        "| 256 | 1 | 30.0 | 40.0 | 80.0 | 60.0 | +50.0 | +30.0 | 0.60 | +40.0 | +20.0 | 0.50 | 0.75 | 0.50 |"
    )


def test_without_kvferry_there_are_no_ratio_columns() -> None:
    table = pd_compare.comparison({"single": cell(30.0), "vllm-push": cell(80.0)})
    assert "kvferry/push" not in table and "| 256 | 1 | 30.0 | 80.0 | +50.0 |" in table


def test_a_cell_without_successful_requests_reads_n_a() -> None:
    table = pd_compare.comparison(
        {"single": cell(30.0), "vllm-push": cell(float("nan")), "kvferry": cell(60.0)}
    )
    assert "| 256 | 1 | 30.0 | nan | 60.0 | n/a | +30.0 | n/a | n/a | 1.00 |" in table


def bench_cell(ttft: float, p99: float, tpot: float, rps: float, ok: int = 10):
    from kvferry.tools.vllmbench import BenchCell

    return [BenchCell(1024, 4.0, ok, 10 - ok, {"p50": ttft, "p99": p99}, {"p50": tpot, "p99": tpot}, rps)]


def test_kvferry_is_held_against_the_best_upstream_mode_of_each_metric() -> None:
    results = {
        "vllm-pull": bench_cell(100.0, 300.0, 9.0, 3.5),
        "vllm-push": bench_cell(80.0, 200.0, 8.0, 3.0),
        "kvferry": bench_cell(120.0, 240.0, 9.0, 3.8),
    }
    row = pd_compare.versus_best(results, "vllm").splitlines()[4]
    assert row == (
        "| 1024 | 4 | 120.0 / 80.0 (vllm-push) = 1.50 | 240.0 / 200.0 (vllm-push) = 1.20 | "
        "9.0 / 8.0 (vllm-push) = 1.12 | 3.8 / 3.5 (vllm-pull) = 1.09 | - |"
    )


def test_a_mode_that_failed_requests_in_a_cell_is_never_the_best_of_it() -> None:
    # Wedged push served 2 of 10 quickly before it stopped answering: those two are not its latency.
    results = {
        "vllm-pull": bench_cell(100.0, 300.0, 9.0, 3.5),
        "vllm-push": bench_cell(90.0, 100.0, 5.0, 9.0, ok=2),
        "kvferry": bench_cell(120.0, 240.0, 9.0, 3.8),
    }
    row = pd_compare.versus_best(results, "vllm").splitlines()[4]
    assert row == (
        "| 1024 | 4 | 120.0 / 100.0 (vllm-pull) = 1.20 | 240.0 / 300.0 (vllm-pull) = 0.80 | "
        "9.0 / 9.0 (vllm-pull) = 1.00 | 3.8 / 3.5 (vllm-pull) = 1.09 | vllm-push 8/10 |"
    )
    only_push = {"vllm-push": results["vllm-push"], "kvferry": results["kvferry"]}
    assert "(none served every request) = n/a" in pd_compare.versus_best(only_push, "vllm")


def test_vllm_bench_serve_results_are_read_by_name() -> None:
    import pytest
    from kvferry.tools.vllmbench import parse_result

    doc = {"completed": 23, "failed": 1, "median_ttft_ms": 101.5, "p99_ttft_ms": 300.0,
           "median_tpot_ms": 8.25, "p99_tpot_ms": 12.0, "request_throughput": 3.9}  # fmt: skip
    cell = parse_result(doc, 1024, 4.0)
    assert (cell.ok, cell.failed, cell.ttft_ms, cell.tpot_ms["p50"], cell.req_per_s) == (
        23, 1, {"p50": 101.5, "p99": 300.0}, 8.25, 3.9,
    )  # fmt: skip
    with pytest.raises(KeyError, match="median_tpot_ms"):
        parse_result({k: v for k, v in doc.items() if k != "median_tpot_ms"}, 1024, 4.0)


def test_the_vllm_clients_words_for_failed_requests_are_kept() -> None:
    from kvferry.tools.vllmbench import failure_lines

    stdout = (
        "Traffic request rate: 32.0\n"
        "Failed requests during benchmark run detected (capping to 10):\n"
        "Error 0: Never received a valid chunk to calculate TTFT.This response will be marked as failed!\n"
        "Error 1: Traceback (most recent call last): ClientPayloadError\n"
        "============ Serving Benchmark Result ============\n"
        "Successful requests:                     254\n"
    )
    assert failure_lines(stdout) == (
        "Never received a valid chunk to calculate TTFT.This response will be marked as failed!",
        "Traceback (most recent call last): ClientPayloadError",
    )
    assert failure_lines("Successful requests: 256\n") == ()
