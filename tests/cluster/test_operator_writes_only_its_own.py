"""On the real API server: every write the operator makes that is not an apply goes through the one
ownership gate (Kube.write_owned). A CR named `db` whose `db-prefill` is another team's StatefulSet
reports Conflict, publishes no revision, and neither its autoscaler (/scale) nor its metrics timer
(engine pod labels) touches that StatefulSet or its pods, nor reads their metrics; its own
StatefulSet is still scaled."""

from __future__ import annotations

import pytest
from kvferry.operator.autoscale import writer
from kvferry.operator.autoscale.loop import Autoscaler
from kvferry.operator.reconcile import steps
from kvferry.operator.reconcile.apply import KubeError, NotControlled
from kvferry.operator.reconcile.network import NodeLayers
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import Inference
from kvferry.operator.status import scrape

from tests.cluster.operator_fixtures import OPERATOR_NAMESPACE
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

LAYER = "topology.k8s.aws/network-node-layer-3"


class NodeSays(NodeLayers):
    """Every node reports network layer nn-a (kwok nodes carry no EC2 topology labels)."""

    def get(self, kube, node: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
        return {LAYER: "nn-a"}


def _bound(cluster, pod: str) -> None:
    """Wait for `pod` (made by its StatefulSet's controller) to be bound to a kwok node."""
    wait_until(lambda: ((cluster.get("pod", pod) or {}).get("spec") or {}).get("nodeName"), f"{pod} bound")


def _foreign(cluster) -> None:
    """Another team's StatefulSet `db-prefill` (no owner) whose pods carry the labels of an engine pod
    of the CR `db` (anyone who can create pods can set labels)."""
    team = {"team": "b"}
    cluster.apps.create_namespaced_stateful_set(
        cluster.ns,
        {
            "metadata": {"name": "db-prefill"},
            "spec": {
                "replicas": 1,
                "serviceName": "db-prefill",
                "selector": {"matchLabels": team},
                "template": {
                    "metadata": {"labels": {**team, "kvferry.io/name": "db", "kvferry.io/role": "prefill"}},
                    "spec": {"containers": [{"name": "db", "image": "example.invalid/none:0"}]},
                },
            },
        },
    )
    _bound(cluster, "db-prefill-0")


def test_a_cr_never_scales_or_labels_what_another_team_named_like_its_objects(cluster, operator_kube) -> None:
    _foreign(cluster)
    autoscaled = (
        make_inference("db", accelerator="p5en")
        .prefill(replicasOwner="autoscaler")
        .decode(replicasOwner="autoscaler")
        .set(
            autoscaling={
                "ttftSeconds": 1.0,
                "itlSeconds": 0.05,
                "prefill": {"minReplicas": 2, "maxReplicas": 3},  # the planner wants 2 at once
                "decode": {"minReplicas": 2, "maxReplicas": 3},
            }
        )
    )
    cluster.apply(autoscaled.obj())
    cfg = OperatorConfig(operator_namespace=OPERATOR_NAMESPACE)
    out = steps.reconcile(operator_kube, Inference.of(cluster.cr("db")), cfg, trigger="create")
    assert "StatefulSet db-prefill exists and is not" in out.conflict, out
    assert cluster.get("statefulset", "db-decode")["metadata"]["ownerReferences"][0]["name"] == "db"
    # No revision after a Conflict: the autoscaler and the metrics timer wait for one.
    assert not cluster.cr("db")["status"].get("revision"), cluster.cr("db")["status"]

    # Even a CR that had a revision (reconciled before the foreign object took the name):
    body = cluster.cr("db")
    body["status"]["revision"] = "r-earlier"
    cr = Inference.of(body)
    events = Autoscaler().evaluate(operator_kube, cr, cfg, fetch=lambda url: None)
    assert cluster.get("statefulset", "db-prefill")["spec"]["replicas"] == 1, events
    assert cluster.get("statefulset", "db-decode")["spec"]["replicas"] == 1  # not planned from theirs either

    fetched: list[str] = []
    pods_cfg = OperatorConfig(
        operator_namespace=OPERATOR_NAMESPACE, transfer_source="pods", metrics_url="http://test/{pod}"
    )
    scrape.scrape(operator_kube, cr, pods_cfg, lambda url: fetched.append(url), nodes=NodeSays())
    assert LAYER not in cluster.get("pod", "db-prefill-0")["metadata"]["labels"]
    assert cluster.get("pod", "db-prefill-0")["status"]["phase"] == "Running"
    assert not [u for u in fetched if "db-prefill" in u], fetched  # their metrics are not read either

    # The gate itself, handed their StatefulSet: refused, nothing written; our own: scaled.
    theirs, ours = cluster.get("statefulset", "db-prefill"), cluster.get("statefulset", "db-decode")
    with pytest.raises(NotControlled, match="db-prefill"):
        writer.scale(operator_kube, theirs, cr.meta.uid, 3)
    assert cluster.get("statefulset", "db-prefill")["spec"]["replicas"] == 1
    writer.scale(operator_kube, ours, cr.meta.uid, 2)
    assert cluster.get("statefulset", "db-decode")["spec"]["replicas"] == 2
    # Over a read that is no longer current: 409, nothing written.
    with pytest.raises(KubeError, match="409"):
        writer.scale(operator_kube, ours, cr.meta.uid, 3)
    assert cluster.get("statefulset", "db-decode")["spec"]["replicas"] == 2


def test_engine_pods_of_the_crs_own_statefulset_are_labelled(cluster, operator_kube) -> None:
    """The positive side of the same gate: a pod the CR's own StatefulSet controls gets its labels."""
    cluster.apply(make_inference("own", accelerator="p5en").obj())
    cfg = OperatorConfig(operator_namespace=OPERATOR_NAMESPACE)
    out = steps.reconcile(operator_kube, Inference.of(cluster.cr("own")), cfg, trigger="create")
    assert not out.conflict and not out.failed, out
    _bound(cluster, "own-prefill-0")
    scrape.scrape(operator_kube, Inference.of(cluster.cr("own")), cfg, lambda url: None, nodes=NodeSays())
    assert cluster.get("pod", "own-prefill-0")["metadata"]["labels"][LAYER] == "nn-a"
