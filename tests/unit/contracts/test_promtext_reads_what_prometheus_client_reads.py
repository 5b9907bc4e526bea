"""contracts/promtext.py, the one Prometheus text parser: the samples prometheus_client's parser reads,
on a vLLM engine's /metrics with the connector loaded (data/vllm_metrics.txt, written by
bench/promtext_bench.py --write) and on the format's corners; what is no exposition is refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from kvferry.contracts import promtext
from prometheus_client.parser import text_string_to_metric_families

ENGINE = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()


def _library(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def _ours(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for s in promtext.samples(text)]


def test_an_engines_metrics_read_as_prometheus_client_reads_them() -> None:
    ours = _ours(ENGINE)
    assert ours == _library(ENGINE)
    names = {name for name, _, _ in ours}
    assert {"vllm:time_to_first_token_seconds_bucket", "kvferry_transfers_total"} <= names
    buckets = [labels["le"] for name, labels, _ in ours if name == "vllm:time_to_first_token_seconds_bucket"]
    assert buckets[-1] == "+Inf" and len(buckets) > 10


CORNERS = """# HELP odd a help line with "quotes" and \\\\ escapes
# TYPE odd gauge
# a plain comment

odd{path="C:\\\\dir\\"q\\"\\nnext",brace="}",comma="a,b"} 1.5 1700000000000
odd{le="+Inf",} +Inf
odd { a = "x" , b="y" } -Inf
odd NaN
odd{} 3
\tspaced\t2\t
"""


def test_escapes_braces_infinities_nan_and_comments_as_the_library_reads_them() -> None:
    ours = _ours(CORNERS)
    assert [(n, lab) for n, lab, _ in ours] == [(n, lab) for n, lab, _ in _library(CORNERS)]
    assert ours[0][1] == {"path": 'C:\\dir"q"\nnext', "brace": "}", "comma": "a,b"} and ours[0][2] == 1.5
    assert ours[1][2] == math.inf and ours[2][1] == {"a": "x", "b": "y"} and ours[2][2] == -math.inf
    assert math.isnan(ours[3][2]) and ours[4] == ("odd", {}, 3.0) and ours[5] == ("spaced", {}, 2.0)


@pytest.mark.parametrize(
    "line",
    [
        "<html>",
        "name_only",
        "glued1",
        "no{a=unquoted} 1",
        'no{a="b" c="d"} 1',
        'twice{a="1",a="2"} 1',
        'open{a="b" 1',
        "under 1_000",
        "word one",
        "bad_ts 1 soon",
    ],
)
def test_a_line_that_is_no_sample_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        list(promtext.samples(f"ok 1\n{line}\n"))
    with pytest.raises(ValueError):
        _library(f"{line}\n")  # the library refuses it too


def test_a_metric_name_is_checked_with_labels_too() -> None:
    """Stricter than the library, which takes any name before a label set."""
    assert _library('9starts{a="b"} 1\n') == [("9starts", {"a": "b"}, 1.0)]
    with pytest.raises(ValueError):
        list(promtext.samples('9starts{a="b"} 1\n'))


def test_flat_keys_sort_labels_and_sums_match_label_subsets() -> None:
    flat = promtext.parse_metrics('r_total{outcome="ok",b="2"} 3\nr_total{b="1",outcome="ok"} 4\nr_total 1\n')
    assert flat == {'r_total{b="2",outcome="ok"}': 3.0, 'r_total{b="1",outcome="ok"}': 4.0, "r_total": 1.0}
    assert promtext.metric_sum(flat, "r_total", outcome="ok") == 7.0
    assert promtext.metric_sum(flat, "r_total") == 8.0 and promtext.metric_sum(flat, "r") == 0.0
