"""Two operator replicas with kopf peering: one leads and reconciles, the other stands by."""

from __future__ import annotations

from tests.cluster.operator_fixtures import EXPECTED_KINDS, kinds_of
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until


def test_two_replicas_elect_one_leader_and_still_reconcile(cluster, start_operator) -> None:
    # No peering object yet: the first operator creates it (kopf alone would only patch one that exists).
    def peerings() -> str:
        return cluster.plane.kubectl("-n", cluster.ns, "get", "kopfpeerings", "-o", "name").stdout.strip()

    assert peerings() == ""
    low = start_operator("--peering", "kvferry", "--priority", "10")
    assert wait_until(peerings, "the peering object") == "kopfpeering.kopf.dev/kvferry"
    assert f"created KopfPeering {cluster.ns}/kvferry for leader election" in low.text()
    high = start_operator("--peering", "kvferry", "--priority", "20")
    wait_until(
        lambda: "Pausing operations in favour of" in low.text(), "the low-priority replica to pause", 90
    )
    cluster.apply(make_inference("lead", accelerator="none", image="vllm:1").obj())
    wait_until(lambda: kinds_of(cluster.owned("lead")) == EXPECTED_KINDS, "objects made by the leader")
    # The objects exist before the handler returns (it writes status after them): wait for its log.
    wait_until(lambda: "Handler 'reconcile' succeeded" in high.text(), "the leader's reconcile to finish")
    assert "Handler 'reconcile' succeeded" not in low.text()
