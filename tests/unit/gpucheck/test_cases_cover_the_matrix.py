"""The GPU check's case list: every backend and page order on each side for each KV dtype, every TP
split and block-size pair, both passes; `--quick` still covers all of it."""

from __future__ import annotations

from kvferry.tools.gpucheck.devkv import Side
from kvferry.tools.gpucheck.pages import BACKENDS, DTYPES, ORDERS
from kvferry.tools.gpucheck.run import BLOCK_PAIRS, TP_SPLITS, cases, features

MODEL = Side("", "", 16, 1, "", layers=2, heads=4, head_dim=64, num_blocks=30, device="cpu")


def test_every_order_is_on_each_side_for_every_backend_and_dtype():
    full = [c for c in cases(MODEL, quick=False, tokens=100) if not c.p.staged]
    for dtype in DTYPES:
        mine = [c for c in full if c.p.kv_dtype == dtype]
        assert {(c.p.backend, c.p.order) for c in mine} == {(b, o) for b in BACKENDS for o in ORDERS}
        assert {c.d.order for c in mine} == set(ORDERS)
    assert {(c.p.tp_size, c.d.tp_size) for c in full} == set(TP_SPLITS)
    assert {(c.p.block_size, c.d.block_size) for c in full} == set(BLOCK_PAIRS)


def test_staged_pass_has_every_dtype_and_split():
    staged = [c for c in cases(MODEL, quick=False, tokens=100) if c.p.staged]
    assert all(c.d.staged for c in staged)
    assert {c.p.kv_dtype for c in staged} == set(DTYPES)
    assert {(c.p.tp_size, c.d.tp_size) for c in staged} == set(TP_SPLITS)


def test_quick_covers_what_the_full_run_covers():
    full, quick = cases(MODEL, quick=False, tokens=100), cases(MODEL, quick=True, tokens=100)
    assert len(quick) < len(full) // 4
    assert set().union(*map(features, quick)) == set().union(*map(features, full))
