"""bench/autoscale_load.py's pure part: per-bucket latency of the open-loop client's samples."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).parents[3] / "bench" / "autoscale_load.py"
_spec = importlib.util.spec_from_file_location("bench_autoscale_load", _path)
assert _spec is not None and _spec.loader is not None
load = sys.modules["bench_autoscale_load"] = importlib.util.module_from_spec(_spec)  # for dataclasses
_spec.loader.exec_module(load)


def test_buckets_split_by_send_time_and_leave_failures_out_of_the_latency() -> None:
    samples = [load.Sample(sent, ttft, 0.02, 8) for sent, ttft in ((1, 0.5), (2, 0.7), (3, 0.9), (12, 4.0))]
    samples.append(load.Sample(4, None, None, 0, "HTTP 503"))
    out = load.buckets(samples, 10.0, 20.0)
    assert [b["n"] for b in out] == [4, 1, 0]
    assert out[0]["failed"] == 1 and out[0]["ttft_p50"] == 0.7
    assert abs(out[0]["ttft_p90"] - 0.86) < 1e-9  # linear between 0.7 and 0.9, as every bench reports
    assert out[1]["ttft_p50"] == 4.0 and out[2]["ttft_p50"] is None and out[2]["itl_p50"] is None
