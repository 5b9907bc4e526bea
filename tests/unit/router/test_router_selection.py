"""Engine selection: load-aware decode choice, revision-safe pairing, clear errors when nothing fits."""

from __future__ import annotations

import pytest
from kvferry.router.config import Endpoint
from kvferry.router.discovery import Pool, endpoints_from_slices
from kvferry.router.selection import LoadTracker, NoBackendError, Selector


def ep(role: str, i: int, revision: str = "r1") -> Endpoint:
    return Endpoint(
        role, f"http://127.0.0.{i + 1}:8000", f"{role}-{i}", f"127.0.0.{i + 1}", 5600, 1, revision
    )


def test_least_loaded_decode_counts_in_flight_then_queue_then_kv() -> None:
    tracker = LoadTracker()
    sel = Selector("least-loaded", tracker)
    pool = Pool(prefill=(ep("prefill", 0),), decode=(ep("decode", 0), ep("decode", 1), ep("decode", 2)))
    tracker.begin(pool.decode[0])
    tracker.observe(pool.decode[1], waiting=0, kv_usage=0.9)
    tracker.observe(pool.decode[2], waiting=0, kv_usage=0.1)
    assert sel.choose(pool)[1].engine_id == "decode-2"
    tracker.observe(pool.decode[2], waiting=3, kv_usage=0.1)
    assert sel.choose(pool)[1].engine_id == "decode-1"


def test_round_robin_alternates_decode_with_one_prefill() -> None:
    sel = Selector("round-robin", LoadTracker())
    pool = Pool(prefill=(ep("prefill", 0),), decode=(ep("decode", 0), ep("decode", 1)))
    assert [sel.choose(pool)[1].engine_id for _ in range(4)] == [
        "decode-0",
        "decode-1",
        "decode-0",
        "decode-1",
    ]


def test_prefill_and_decode_of_different_revisions_are_never_paired() -> None:
    sel = Selector("least-loaded", LoadTracker())
    pool = Pool(
        prefill=(ep("prefill", 0, "old"), ep("prefill", 1, "new")),
        decode=(ep("decode", 0, "old"), ep("decode", 1, "new")),
    )
    for _ in range(20):
        p, d = sel.choose(pool)
        sel.tracker.begin(d)  # spread load so both decode revisions get picked
        assert p.revision == d.revision
    only_new_decode = Pool(prefill=(ep("prefill", 0, "old"),), decode=(ep("decode", 1, "new"),))
    with pytest.raises(NoBackendError, match="shares a revision"):
        sel.choose(only_new_decode)


def test_cooling_down_engine_is_avoided_until_it_is_the_only_one() -> None:
    tracker = LoadTracker(cooldown_s=5)
    sel = Selector("least-loaded", tracker)
    pool = Pool(prefill=(ep("prefill", 0),), decode=(ep("decode", 0), ep("decode", 1)))
    tracker.mark_down(pool.decode[0], now=100.0)
    assert sel.choose(pool, now=101.0)[1].engine_id == "decode-1"
    tracker.mark_down(pool.decode[1], now=100.0)
    assert sel.choose(pool, now=101.0)[1].engine_id in ("decode-0", "decode-1")
    assert sel.choose(pool, now=106.0)[1].engine_id == "decode-0"


def test_empty_roles_are_named() -> None:
    sel = Selector("least-loaded", LoadTracker())
    with pytest.raises(NoBackendError, match="no decode engine"):
        sel.choose(Pool(prefill=(ep("prefill", 0),)))
    with pytest.raises(NoBackendError, match="no prefill engine"):
        sel.choose(Pool(decode=(ep("decode", 0),)))


def test_endpoint_slices_give_ready_pods_with_revisions() -> None:
    slices = [
        {
            "metadata": {"name": "x-decode-abc"},
            "ports": [{"name": "http", "port": 8000}, {"name": "side-channel", "port": 5600}],
            "endpoints": [
                {"addresses": ["10.0.0.5"], "conditions": {"ready": True},
                 "targetRef": {"kind": "Pod", "name": "x-decode-1"}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": False},
                 "targetRef": {"kind": "Pod", "name": "x-decode-0"}},
                {"addresses": ["fd00::7"], "conditions": {},
                 "targetRef": {"kind": "Pod", "name": "x-decode-2"}},
            ],
        },
        {"metadata": {"name": "no-ports"}, "ports": [], "endpoints": [{"addresses": ["10.0.0.9"]}]},
    ]  # fmt: skip
    labels = {"x-decode-1": {"kvferry.io/revision": "abc"}, "x-decode-2": {"kvferry.io/revision": "def"}}
    found = endpoints_from_slices(slices, labels, "decode", 2, "kvferry.io/revision")
    assert [(e.engine_id, e.url, e.side_host, e.side_port, e.tp_size, e.revision) for e in found] == [
        ("x-decode-1", "http://10.0.0.5:8000", "10.0.0.5", 5600, 2, "abc"),
        ("x-decode-2", "http://[fd00::7]:8000", "fd00::7", 5600, 2, "def"),
    ]


def test_tracker_forgets_engines_that_left_the_pool_unless_busy() -> None:
    tracker = LoadTracker()
    old = Pool(prefill=(ep("prefill", 0),), decode=(ep("decode", 0), ep("decode", 1), ep("decode", 2)))
    for e in (*old.prefill, *old.decode):
        tracker.observe(e, waiting=1, kv_usage=0.5)
    tracker.begin(old.decode[1])  # a leg still running on a pod that is going away
    new = Pool(prefill=(ep("prefill", 0),), decode=(ep("decode", 0), ep("decode", 3)))
    tracker.prune(new)
    assert set(tracker.loads) == {old.prefill[0].url, old.decode[0].url, old.decode[1].url}
    assert tracker.loads[old.decode[0].url].waiting == 1, "engines still in the pool keep their load"
    tracker.end(old.decode[1])
    tracker.prune(new)
    assert set(tracker.loads) == {old.prefill[0].url, old.decode[0].url}
    tracker.end(old.decode[1])  # a late end() for a forgotten engine does not bring it back
    assert old.decode[1].url not in tracker.loads


def test_in_flight_series_of_engines_that_left_the_pool_are_dropped():
    from kvferry.router.metrics import RouterMetrics

    m = RouterMetrics()
    m.in_flight.labels("decode", "d-old").inc()
    m.in_flight.labels("decode", "d-old").dec()
    m.in_flight.labels("decode", "d-busy").inc()
    m.in_flight.labels("prefill", "p-0").inc()
    m.in_flight.labels("prefill", "p-0").dec()
    m.forget_engines({("prefill", "p-0")})
    text = m.render().decode()
    assert 'engine_id="d-old"' not in text  # gone and idle: dropped
    assert 'engine_id="d-busy"' in text and 'engine_id="p-0"' in text  # busy, or still in the pool
