"""transfer_metrics: Prometheus text -> totals, quantiles and the TransferHealthy verdict."""

from __future__ import annotations

import pytest
from kvferry.operator.status import transfer as tm
from kvferry.operator.status.conditions import Reason


def metrics(
    transfers: int,
    failures: int = 0,
    backend: str = "LIBFABRIC",
    local: int = 0,
    external: int = 0,
    buckets: tuple = ((0.01, 10), (0.05, 90), (0.1, 100)),
    refused: int = 0,
) -> str:
    lines = [
        "# TYPE kvferry_transfers counter",
        f'kvferry_transfers_total{{backend="{backend}"}} {transfers}',
        "# TYPE kvferry_transfer_failures counter",
        f'kvferry_transfer_failures_total{{reason="timeout"}} {failures}',
        f'kvferry_transfer_failures_total{{reason="layout_mismatch"}} {refused}',
        "# TYPE kvferry_transfer_seconds histogram",
    ]
    for le, count in buckets:
        lines.append(f'kvferry_transfer_seconds_bucket{{le="{le}"}} {count * transfers // 100}')
    lines += [
        f'kvferry_transfer_seconds_bucket{{le="+Inf"}} {transfers}',
        f"kvferry_transfer_seconds_count {transfers}",
        "kvferry_transfer_seconds_sum 1.0",
        "# TYPE vllm:prompt_tokens_by_source counter",
        f'vllm:prompt_tokens_by_source_total{{source="local_compute"}} {local}',
        f'vllm:prompt_tokens_by_source_total{{source="external_kv_transfer"}} {external}',
    ]
    return "\n".join(lines) + "\n"


def _run(prod: list[str], cons: list[str], previous: dict | None = None, efa: bool = True):
    return tm.summarize(prod, cons, previous=previous or {}, mode="push", efa=efa, now="t")


def test_totals_and_quantiles_add_up_over_pods() -> None:
    summary, verdict = _run([metrics(100), metrics(100)], [metrics(0, external=1000, local=10)])
    assert summary["transfers"] == 200 and summary["scrapedPods"] == 3
    assert 0.01 < summary["p50Seconds"] < 0.05 and summary["p50"].endswith("ms")
    assert 0.05 <= summary["p99Seconds"] <= 0.1
    assert verdict[:2] == ("True", Reason.TRANSFERS_OK)


def test_new_failures_make_transfers_unhealthy_with_the_reason() -> None:
    summary, verdict = _run([metrics(100, failures=3)], [], previous={"failures": 1})
    assert verdict[:2] == ("False", Reason.TRANSFER_FAILURES) and "2 transfers failed" in verdict[2]
    assert (summary["lastFailure"], summary["lastFailureTime"]) == ("timeout", "t")
    _, again = _run([metrics(120, failures=3)], [], previous=summary)
    assert again[0] == "True"


def test_layout_refusals_are_named_before_other_failures() -> None:
    refused = metrics(0, refused=4)
    summary, verdict = _run([metrics(10)], [refused])
    assert verdict[:2] == ("False", Reason.LAYOUT_MISMATCH) and "4 transfers refused" in verdict[2]
    assert summary["layoutMismatches"] == 4
    _, again = _run([metrics(20)], [refused], previous=summary)  # no new refusals: healthy again
    assert again[1] != Reason.LAYOUT_MISMATCH


def test_ucx_on_efa_and_decode_recompute_are_named() -> None:
    assert _run([metrics(10, backend="UCX")], [])[1][1] == Reason.WRONG_BACKEND
    assert _run([metrics(10, backend="UCX")], [], efa=False)[1][1] == Reason.TRANSFERS_OK
    verdict = _run([metrics(10)], [metrics(0, local=900, external=100)])[1]
    assert verdict[:2] == ("False", Reason.DECODE_RECOMPUTES)


def test_unreadable_or_missing_metrics_are_unknown_not_healthy() -> None:
    assert _run(["not prometheus {{{"], [])[1][:2] == ("Unknown", Reason.METRICS_UNAVAILABLE)
    assert _run([], [])[1][0] == "Unknown"


@pytest.mark.parametrize(("q", "expected"), [(0.5, 0.03), (0.1, 0.01), (1.0, 0.1)])
def test_quantile_interpolates_inside_buckets(q: float, expected: float) -> None:
    buckets = {0.01: 10.0, 0.05: 90.0, 0.1: 100.0, float("inf"): 100.0}
    assert tm.quantile(buckets, q) == pytest.approx(expected, rel=0.01)


def test_connector_preflight_names_the_backend_and_flags_ucx_on_efa() -> None:
    text = (
        '# TYPE kvferry_preflight_ok gauge\nkvferry_preflight_ok{check="backend_UCX"} 1\n'
        'kvferry_preflight_ok{check="ucx_on_efa"} 0\n'
    )
    sample = tm.parse(text)
    assert sample.backends == {"UCX"} and sample.ucx_on_efa
    assert _run([metrics(5) + text], [], efa=False)[1][1] == Reason.WRONG_BACKEND


def test_the_connectors_transfer_histogram_feeds_the_quantiles() -> None:
    text = (
        "# TYPE kvferry_match_to_done_seconds histogram\n"
        'kvferry_match_to_done_seconds_bucket{le="0.01"} 50\n'
        'kvferry_match_to_done_seconds_bucket{le="0.1"} 100\n'
        'kvferry_match_to_done_seconds_bucket{le="+Inf"} 100\n'
        "kvferry_match_to_done_seconds_count 100\nkvferry_match_to_done_seconds_sum 1\n"
        '# TYPE kvferry_transfers counter\nkvferry_transfers_total{role="producer"} 100\n'
    )
    summary, _ = _run([text], [])
    assert summary["p50Seconds"] == pytest.approx(0.01) and summary["transfers"] == 100


def test_a_failed_start_up_check_makes_transfers_unhealthy_naming_role_and_check() -> None:
    gauge = '# TYPE kvferry_preflight_ok gauge\nkvferry_preflight_ok{check="%s"} %d\n'
    ok = metrics(10) + gauge % ("backend_LIBFABRIC", 1) + gauge % ("efa_device", 1)
    no_efa = metrics(10) + gauge % ("backend_LIBFABRIC", 1) + gauge % ("efa_device", 0)
    assert _run([ok], [ok])[1][:2] == ("True", Reason.TRANSFERS_OK)
    status, reason, message = _run([ok], [no_efa])[1]
    assert (status, reason) == ("False", Reason.PREFLIGHT_FAILED)
    assert "decode efa_device" in message and "prefill" not in message
