"""The GangAdmitted condition on the real API server, written by the real operator: with neither Kueue nor
coscheduling installed (the local plane), a service says that its roles are placed one pod at a time,
and a service that asks for a Kueue gang says that nothing admits it."""

from __future__ import annotations

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until


def test_without_a_gang_scheduler_the_status_says_so(cluster, operator) -> None:
    cluster.apply(make_inference("solo").obj())
    cluster.apply(make_inference("gang", placement={"gang": "kueue", "queueName": "gpu"}).obj())
    for name, reason, words in (
        ("solo", "NoGangScheduler", "one by one"),
        ("gang", "GangSchedulerMissing", "no kueue.x-k8s.io"),
    ):
        cond = wait_until(
            lambda n=name: cluster.condition(n, "GangAdmitted"), f"{name}: GangAdmitted written", until=bool
        )
        assert (cond["status"], cond["reason"]) == ("False", reason), cond
        assert words in cond["message"], cond["message"]
    # The gang's pods still carry the group the moment Kueue is installed (and nothing else changes).
    (pod,) = wait_until(lambda: cluster.pods("gang", "decode"), "the gang's decode pod")
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "gang-engines"
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "2"
