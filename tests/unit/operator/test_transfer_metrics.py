"""transfer_metrics: Prometheus text -> totals, quantiles and the TransferHealthy verdict."""

from __future__ import annotations

import pytest
from kvferry.contracts import metrics as m
from kvferry.operator.status import transfer as tm
from kvferry.operator.status.conditions import Reason

HIST = m.MATCH_TO_DONE_SECONDS
GAUGE = f'# TYPE {m.PREFLIGHT_OK} gauge\n{m.PREFLIGHT_OK}{{{m.CHECK}="%s"}} %d\n'


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
        f"# TYPE {m.TRANSFERS} counter",
        f'{m.total(m.TRANSFERS)}{{{m.BACKEND}="{backend}"}} {transfers}',
        f"# TYPE {m.TRANSFER_FAILURES} counter",
        f'{m.total(m.TRANSFER_FAILURES)}{{{m.REASON}="timeout"}} {failures}',
        f'{m.total(m.TRANSFER_FAILURES)}{{{m.REASON}="{m.LAYOUT_MISMATCH}"}} {refused}',
        f"# TYPE {HIST} histogram",
    ]
    for le, count in buckets:
        lines.append(f'{HIST}_bucket{{le="{le}"}} {count * transfers // 100}')
    lines += [
        f'{HIST}_bucket{{le="+Inf"}} {transfers}',
        f"{HIST}_count {transfers}",
        f"{HIST}_sum 1.0",
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


def test_a_sentinel_mismatch_on_decode_is_named_first() -> None:
    """KV that arrived wrong outranks every other verdict, and clears once no new mismatch comes."""
    wrong = metrics(0).replace(f'{m.REASON}="timeout"}} 0', f'{m.REASON}="{m.SAMPLE_MISMATCH}"}} 2')
    summary, verdict = _run([metrics(10, refused=3)], [wrong])
    assert verdict[:2] == ("False", Reason.SAMPLE_MISMATCH) and "2 receives" in verdict[2]
    assert summary["sampleMismatches"] == 2
    _, again = _run([metrics(20)], [wrong], previous=summary)
    assert again[1] != Reason.SAMPLE_MISMATCH


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
    text = GAUGE % (m.CHECK_BACKEND + "UCX", 1) + GAUGE % (m.CHECK_UCX_ON_EFA, 0)
    sample = tm.parse(text)
    assert sample.backends == {"UCX"} and sample.ucx_on_efa
    assert _run([metrics(5) + text], [], efa=False)[1][1] == Reason.WRONG_BACKEND


def test_the_connectors_transfer_histogram_feeds_the_quantiles() -> None:
    text = (
        f"# TYPE {HIST} histogram\n"
        f'{HIST}_bucket{{le="0.01"}} 50\n'
        f'{HIST}_bucket{{le="0.1"}} 100\n'
        f'{HIST}_bucket{{le="+Inf"}} 100\n'
        f"{HIST}_count 100\n{HIST}_sum 1\n"
        f'# TYPE {m.TRANSFERS} counter\n{m.total(m.TRANSFERS)}{{role="producer"}} 100\n'
    )
    summary, _ = _run([text], [])
    assert summary["p50Seconds"] == pytest.approx(0.01) and summary["transfers"] == 100


def test_a_failed_start_up_check_makes_transfers_unhealthy_naming_role_and_check() -> None:
    ok = metrics(10) + GAUGE % (m.CHECK_BACKEND + "LIBFABRIC", 1) + GAUGE % ("efa_device", 1)
    no_efa = metrics(10) + GAUGE % (m.CHECK_BACKEND + "LIBFABRIC", 1) + GAUGE % ("efa_device", 0)
    assert _run([ok], [ok])[1][:2] == ("True", Reason.TRANSFERS_OK)
    status, reason, message = _run([ok], [no_efa])[1]
    assert (status, reason) == ("False", Reason.PREFLIGHT_FAILED)
    assert "decode efa_device" in message and "prefill" not in message


def test_receives_decode_holds_for_a_silent_producer_are_counted_from_the_connectors_gauge() -> None:
    """The connector's own pending gauge, as the consumer core names it, summed over decode pods."""
    from kvferry.connector.consumer import ConsumerCore
    from kvferry.connector.metrics import Metrics
    from prometheus_client import generate_latest

    core = ConsumerCore(total_heads=4, rank=0, tp_size=1)
    core.expect(("r", 0), "p0", producer_tp=1, deadline_s=1, now=0.0)
    core.tick(now=1.0)
    core.tick(now=1.0 + core.limits.grace_s)  # past deadline + grace, the producer silent: held
    gauge = Metrics()
    for kind, n in core.pending().items():
        gauge.record("pending", n, "consumer", kind, "0")
    text = generate_latest(gauge.registry).decode()
    summary, _ = _run([metrics(10)], [metrics(0) + text, metrics(0) + text])
    assert summary["heldReceives"] == 2
    summary, _ = _run([metrics(10)], [metrics(0)])
    assert summary["heldReceives"] == 0
