"""Closest-pair preference: with several prefill and decode engines, the router pairs engines in the same
zone, then under the same network spine, bounded by load like the prefix scorer (router/topology.py,
scoring.py, selection.py); discovery reads the zone from EndpointSlices."""

from __future__ import annotations

import pytest
from kvferry.contracts.labels import NETWORK_LAYERS, ZONE
from kvferry.router import topology
from kvferry.router.config import Endpoint
from kvferry.router.discovery import Pool, endpoints_from_slices
from kvferry.router.selection import LoadTracker, Selector


def ep(role: str, i: int, *place: str) -> Endpoint:
    host = f"127.0.{0 if role == 'prefill' else 1}.{i + 1}"
    return Endpoint(role, f"http://{host}:8000", f"{role}-{i}", host, 5600, 1, "r1", tuple(place))


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        (("us-east-2a", "nn-1", "nn-2", "nn-3"), ("us-east-2a", "nn-1", "nn-2", "nn-3"), 4),
        (("us-east-2a", "nn-1", "nn-2", "nn-3"), ("us-east-2a", "nn-1", "nn-2", "nn-9"), 3),
        (("us-east-2a", "nn-1"), ("us-east-2a", "nn-7"), 1),
        (("us-east-2a",), ("us-east-2b",), 0),
        (("", "nn-1"), ("", "nn-1"), 0),  # unknown zone: nothing below it counts
        ((), ("us-east-2a",), 0),
    ],
)
def test_closeness_counts_shared_leading_levels(a: tuple[str, ...], b: tuple[str, ...], n: int) -> None:
    assert topology.closeness(a, b) == topology.closeness(b, a) == n


def test_place_takes_the_slice_zone_then_the_pods_network_labels() -> None:
    labels = {NETWORK_LAYERS[0]: "nn-1", NETWORK_LAYERS[1]: "nn-2", NETWORK_LAYERS[2]: "nn-3"}
    assert topology.place("us-east-2a", labels) == ("us-east-2a", "nn-1", "nn-2", "nn-3")
    assert topology.place(None, {ZONE: "us-east-2b"}) == ("us-east-2b",)  # the pod's copied zone label
    assert topology.place(None, {}) == ()


def test_prefill_in_decodes_zone_wins_over_a_lower_ranked_one_elsewhere() -> None:
    sel = Selector("least-loaded", LoadTracker(), load_bound=2)
    pool = Pool(prefill=(ep("prefill", 0, "b"), ep("prefill", 1, "a")), decode=(ep("decode", 0, "a"),))
    p, d = sel.choose(pool)
    assert (p.engine_id, d.engine_id) == ("prefill-1", "decode-0")


def test_decode_with_a_prefill_in_its_zone_wins() -> None:
    # decode-0 ranks first by load, but only zone b has a prefill: pair inside zone b.
    sel = Selector("least-loaded", LoadTracker(), load_bound=2)
    pool = Pool(prefill=(ep("prefill", 0, "b"),), decode=(ep("decode", 0, "a"), ep("decode", 1, "b")))
    p, d = sel.choose(pool)
    assert (p.engine_id, d.engine_id) == ("prefill-0", "decode-1")


def test_same_spine_wins_inside_one_zone() -> None:
    sel = Selector("least-loaded", LoadTracker(), load_bound=2)
    pool = Pool(
        prefill=(
            ep("prefill", 0, "a", "nn-1", "nn-2", "nn-3"),
            ep("prefill", 1, "a", "nn-1", "nn-5", "nn-6"),
        ),
        decode=(ep("decode", 0, "a", "nn-1", "nn-5", "nn-7"),),
    )
    assert sel.choose(pool)[0].engine_id == "prefill-1"  # shares layers 1-2 with decode, prefill-0 only 1


def test_closeness_is_bounded_by_load() -> None:
    tracker = LoadTracker()
    sel = Selector("least-loaded", tracker, load_bound=2)
    pool = Pool(prefill=(ep("prefill", 0, "b"), ep("prefill", 1, "a")), decode=(ep("decode", 0, "a"),))
    for _ in range(2):
        tracker.begin(pool.prefill[1])
    assert sel.choose(pool)[0].engine_id == "prefill-1"  # 2 busier: within the bound, still closest
    tracker.begin(pool.prefill[1])
    assert sel.choose(pool)[0].engine_id == "prefill-0"  # 3 busier: load wins, the pair crosses zones


def test_without_topology_selection_is_by_load_alone() -> None:
    tracker = LoadTracker()
    sel = Selector("least-loaded", tracker, load_bound=2)
    pool = Pool(prefill=(ep("prefill", 0), ep("prefill", 1)), decode=(ep("decode", 0), ep("decode", 1)))
    tracker.begin(pool.prefill[0])
    assert [e.engine_id for e in sel.choose(pool)] == ["prefill-1", "decode-0"]


def test_discovery_reads_each_endpoints_zone_from_the_slice() -> None:
    slices = [
        {
            "ports": [{"name": "http", "port": 8000}, {"name": "side-channel", "port": 5600}],
            "endpoints": [
                {
                    "addresses": ["10.0.0.1"],
                    "zone": "us-east-2a",
                    "targetRef": {"kind": "Pod", "name": "p-0"},
                },
                {"addresses": ["10.0.0.2"], "targetRef": {"kind": "Pod", "name": "p-1"}},
            ],
        }
    ]
    labels = {"p-0": {"kvferry.io/revision": "r1", NETWORK_LAYERS[0]: "nn-1"}}
    found = endpoints_from_slices(slices, labels, "prefill", 1, "kvferry.io/revision")
    assert [e.topology for e in found] == [("us-east-2a", "nn-1"), ()]


def test_the_router_app_pairs_inside_one_zone_over_the_load_only_order() -> None:
    """Through the whole router app over HTTP with stand-in engines. By load alone (all idle, ties by
    engine id) prefill-0 in zone b would serve decode-0 in zone a; the zone-a prefill-1 serves instead."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer
    from kvferry.router.app import build_app
    from kvferry.router.config import parse_config

    from tests.unit.router.engines import FakeEngine

    zones = {"prefill-0": "b", "prefill-1": "a", "decode-0": "a", "decode-1": "b"}

    async def main() -> dict[str, int]:
        engines = {name: FakeEngine(name) for name in zones}
        for e in engines.values():
            await e.server.start_server()

        def entries(role: str) -> list[dict[str, object]]:
            return [
                {
                    "url": e.url,
                    "engine_id": n,
                    "side_host": "127.0.0.1",
                    "side_port": 5600 + i,
                    "topology": [f"zone-{zones[n]}"],
                }  # fmt: skip
                for i, (n, e) in enumerate(engines.items())
                if n.startswith(role)
            ]

        cfg = {
            "mode": "kvferry",
            "model": "tiny",
            "routing": {"disaggregation": {"rule": "always"}},
            "discovery": {"static": {"prefill": entries("prefill"), "decode": entries("decode")}},
        }
        client = TestClient(TestServer(build_app(parse_config(cfg)), host="127.0.0.1"))
        await client.start_server()
        try:
            for i in range(3):
                body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 2}
                assert (await client.post("/v1/completions", json=body)).status == 200
        finally:
            await client.close()
            for e in engines.values():
                await e.server.close()
        return {n: len(e.seen) for n, e in engines.items()}

    assert asyncio.run(main()) == {"prefill-0": 0, "prefill-1": 3, "decode-0": 3, "decode-1": 0}
