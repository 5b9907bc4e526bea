"""Engine /metrics comes from an image the CR's author chose: before it is parsed, the
operator keeps only the families it reads, at most MAX_LINES lines of at most MAX_LINE characters,
and failure reasons (label values a peer chose) of a known shape and number."""

from __future__ import annotations

import pytest
from kvferry.contracts import metrics as m
from kvferry.operator.autoscale import signals
from kvferry.operator.status import metricstext, transfer
from kvferry.operator.status.metricstext import MAX_LINE, MAX_LINES, MAX_REASONS, OTHER

FAILED = m.total(m.TRANSFER_FAILURES)


def test_only_the_families_read_are_kept_and_at_most_max_lines() -> None:
    junk = [f'vllm:some_other_family{{i="{i}"}} 1' for i in range(10 * MAX_LINES)]
    ours = [f'{m.total(m.TRANSFERS)}{{role="producer",n="{i}"}} 1' for i in range(2 * MAX_LINES)]
    long = f'{m.total(m.TRANSFERS)}{{role="producer",pad="{"x" * MAX_LINE}"}} 1'
    text = "\n".join(["# HELP x y", f"# TYPE {m.total(m.TRANSFERS)} counter", long, *junk, *ours])
    kept = metricstext.relevant(text, transfer.READ).splitlines()
    assert len(kept) == MAX_LINES and kept[0].startswith("# TYPE kvferry_")
    assert all(line.startswith(("kvferry_", "# TYPE kvferry_")) and len(line) <= MAX_LINE for line in kept)
    assert transfer.parse(text).transfers == MAX_LINES - 1  # the first MAX_LINES - 1 samples, no more


def test_an_engines_own_families_all_survive_the_cut() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:time_to_first_token_seconds histogram",
            'vllm:time_to_first_token_seconds_bucket{le="1.0"} 4',
            'vllm:time_to_first_token_seconds_bucket{le="+Inf"} 5',
            'vllm:num_requests_waiting{model_name="m"} 3',
            'vllm:num_requests_running{model_name="m"} 2',
            'vllm:kv_cache_usage_perc{engine="0"} 0.5',
            'vllm:request_prefill_time_seconds_sum{model_name="m"} 7.5',
            "process_cpu_seconds_total 12.0",
        ]
    )
    s = signals.parse_engine(text)
    assert (s.ttft, s.waiting, s.running, s.kv_usage, s.prefill_s) == (
        {1.0: 4.0, float("inf"): 5.0},
        3,
        2,
        0.5,
        7.5,
    )


def test_text_that_is_no_exposition_is_still_refused() -> None:
    for text in ("<html>not metrics</html>\n{", "not prometheus {{{"):
        with pytest.raises(ValueError):
            metricstext.relevant(text, transfer.READ)


def test_failure_reasons_a_peer_chose_are_bounded_in_shape_and_number() -> None:
    lines = [f'{FAILED}{{role="producer",reason="r{i:03d}"}} 1' for i in range(200)]
    lines += [f'{FAILED}{{role="producer",reason="<script>{i}"}} 1' for i in range(5)]
    lines.append(f'{FAILED}{{role="producer",reason="{m.LAYOUT_MISMATCH}"}} 2')
    sample = transfer.parse("\n".join(lines))
    assert len(sample.failures_by_reason) == MAX_REASONS + 2
    assert sample.failures_by_reason[OTHER] == 200 - MAX_REASONS + 5
    assert sample.failures_by_reason[m.LAYOUT_MISMATCH] == 2  # one the verdict acts on: never lumped
    assert sample.failures == 207
