"""The sentinel (connector/sentinel.py) fails a receive whose KV is not what prefill sent.

Real producer and consumer processes over NIXL, every request sampled. A clean push lands and its
sample checks out; then the producer's KV is cleared after the sentinel digested it and before the
WRITE (a planted fault: the bytes that land are not the bytes that were sent). The consumer must not
report that KV received: the receive fails with `sample_mismatch` (vLLM's kv_load_failure_policy
then recomputes), counted in kvferry_sentinel_checks_total and kvferry_transfer_failures_total.
"""

from __future__ import annotations

import pytest
from kvferry.contracts.promtext import metric_sum, parse_metrics
from kvferry.tools.hostkv import CacheShape

from tests.nixl.helpers import expect_args

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize(
    ("p_shape", "d_shape"),
    [
        (CacheShape(block_size=16), CacheShape(block_size=16)),
        (CacheShape(block_size=16, tp_size=2), CacheShape(block_size=32, order="token_major")),
    ],
    ids=["same-layout", "tp2-bs16-to-bs32"],
)
def test_a_corrupted_push_fails_the_receive_by_name(procs, p_shape, d_shape):
    prods = procs.start("producer", "prefill-0", p_shape, ranks=p_shape.tp_size, sentinel_every=1)
    (cons,) = procs.start("consumer", "decode-0", d_shape, sentinel_every=1)
    tokens, p_blocks, d_blocks = 90, [3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4]
    d_blocks = d_blocks[: -(-tokens // d_shape.block_size)]
    cons.call("expect", "ok", 0, expect_args(prods[0], d_blocks, tokens, tp=p_shape.tp_size))
    for p in prods:
        p.call("finish", "ok", 0, p_blocks, tokens, "decode-0")
    assert cons.call("results", 20.0, 1)["received"] == [("ok", 0)]
    assert cons.call("mismatches", d_blocks, tokens) == 0
    checks = parse_metrics(cons.call("metrics"))
    assert metric_sum(checks, "kvferry_sentinel_checks_total", result="ok") == p_shape.tp_size

    for p in prods:
        p.call("corrupt_writes")
    cons.call("expect", "bad", 0, expect_args(prods[0], d_blocks, tokens, tp=p_shape.tp_size))
    for p in prods:
        p.call("finish", "bad", 0, p_blocks, tokens, "decode-0")
    assert cons.call("results", 20.0, 1)["failed"] == [(("bad", 0), "sample_mismatch")]
    after = parse_metrics(cons.call("metrics"))
    assert metric_sum(after, "kvferry_sentinel_checks_total", result="mismatch") >= 1
    assert metric_sum(after, "kvferry_transfer_failures_total", reason="sample_mismatch") == 1
