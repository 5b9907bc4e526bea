"""On the real API server: operator.shards changed 1 -> 2 -> 3 with live CRs, then the CRs deleted.

kopf removes only its own finalizer, whose name carries the shard layout
(`kvferry.io/finalizer-shard-i-of-n`), so each reshard leaves the old layout's name on every CR. The
serving replica removes the operator's other finalizers once a CR is being deleted (operator/
finalizers.py `stale`); without that the CRs, and their namespace, would stay Terminating."""

from __future__ import annotations

from kubernetes.client.rest import ApiException
from kvferry.operator.runtime.handlers import shard_finalizer
from kvferry.operator.runtime.shard import shard_of

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

NAMES = [f"r{i}" for i in range(5)]


def _ours(cluster, name: str) -> list[str]:
    return [f for f in cluster.cr(name)["metadata"].get("finalizers") or [] if f.startswith("kvferry.io/")]


def _served_by(cluster, count: int) -> None:
    """Every CR carries the finalizer of its replica in the `count`-shard layout."""
    for name in NAMES:
        want = shard_finalizer(shard_of(cluster.ns, name, count), count)
        wait_until(lambda n=name, w=want: w in _ours(cluster, n), f"{name} served by {want}")


def test_a_reshard_one_two_three_then_delete_leaves_no_cr_behind(cluster, start_operator) -> None:
    running = [start_operator("--shard", "0/1")]
    for name in NAMES:
        cluster.apply(make_inference(name).obj())
    _served_by(cluster, 1)
    for count in (2, 3):
        # A rolling change: the new layout starts before the old one stops (both serve for a while).
        new = [start_operator("--shard", f"{i}/{count}") for i in range(count)]
        _served_by(cluster, count)
        for op in running:
            op.stop()
        running = new
    # Every CR now carries its names of all three layouts; only the 3-shard replicas run.
    assert all(len(_ours(cluster, n)) == 3 for n in NAMES), {n: _ours(cluster, n) for n in NAMES}

    cluster.kubectl("delete", "disaggregatedinferences", "--all", "--wait=false")

    def left() -> dict[str, list[str]]:
        res = cluster.kubectl("get", "disaggregatedinferences", "-o", "name", check=False)
        return {n.split("/")[-1]: _ours(cluster, n.split("/")[-1]) for n in res.stdout.split() if n}

    # A 404 between the list and the read is a CR that just went.
    wait_until(
        left, "every CR deleted (no stale finalizer left)", until=lambda v: v == {}, ignore=(ApiException,)
    )
