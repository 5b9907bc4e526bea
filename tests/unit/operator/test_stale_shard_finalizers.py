"""finalizers.stale: on a CR being deleted, the operator's finalizers of any shard layout but the
serving replica's own are stale (kopf removes only its own name); a live CR keeps them all."""

from __future__ import annotations

from kvferry.operator.runtime.finalizers import stale
from kvferry.operator.runtime.handlers import shard_finalizer


def _cr(finalizers: list[str], deleting: bool = True) -> dict:
    meta = {"name": "a", "namespace": "ns", "finalizers": finalizers}
    return {"metadata": {**meta, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}}


def test_every_other_layouts_finalizer_is_stale_once_the_cr_is_deleted() -> None:
    one, two, three = shard_finalizer(0, 1), shard_finalizer(1, 2), shard_finalizer(2, 3)
    assert (one, two, three) == (
        "kvferry.io/finalizer",
        "kvferry.io/finalizer-shard-1-of-2",
        "kvferry.io/finalizer-shard-2-of-3",
    )
    others = ["example.com/keep", "kopf.zalando.org/KopfFinalizerMarker"]
    assert stale(_cr([one, two, three, *others]), three) == [one, two, others[1]]
    assert stale(_cr([three, "example.com/keep"]), three) == []
    assert stale(_cr([one, two]), three) == [one, two]  # the serving replica never added its own


def test_a_live_cr_keeps_them_all() -> None:
    # A replica of the old layout may still run mid-rollout and would only add its finalizer back.
    assert (
        stale(_cr([shard_finalizer(0, 1), shard_finalizer(0, 2)], deleting=False), shard_finalizer(0, 2))
        == []
    )
