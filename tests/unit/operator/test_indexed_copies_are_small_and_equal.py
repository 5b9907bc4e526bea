"""The operator's indexes (issue 19, memory at 1,000 CRs): the `owned` index keeps only what the status,
drift and autoscale code reads of a workload, and gives the same status as the whole object; the CR and
managed-object indexes hold packed copies that unpack to exactly what was indexed."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kvferry.operator.fleet import packed
from kvferry.operator.render.objects import render
from kvferry.operator.runtime import handlers
from kvferry.operator.spec import Inference, names
from kvferry.operator.status.conditions import Observed, summarize
from kvferry.operator.status.publish import desired_replicas, newer

from tests.unit.operator.cases import make_inference

NS = "ns"


def _cr(autoscaled: bool = False) -> dict[str, Any]:
    cr = make_inference("big", namespace=NS).prefill(replicas=2).decode(replicas=3).obj()
    if autoscaled:
        cr["spec"]["decode"]["replicasOwner"] = "autoscaler"
    cr["metadata"]["uid"] = "u-1"
    return cr


def _served(obj: dict[str, Any], rv: int, status: dict[str, Any]) -> dict[str, Any]:
    """A rendered object as the API server returns it: server fields, defaults' bulk, a status."""
    out = copy.deepcopy(obj)
    meta = out["metadata"]
    meta.update(
        uid=f"uid-{meta['name']}",
        resourceVersion=str(rv),
        generation=2,
        creationTimestamp="2026-12-02T10:00:00Z",
        managedFields=[{"manager": "kvferry", "fieldsV1": {"f:spec": {"f:template": {"x": "y" * 3000}}}}],
    )
    out["status"] = status
    return out


def _workloads(cr: dict[str, Any], status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """role -> the CR's StatefulSets and router Deployment as served, each with `status`."""
    out = {}
    for i, obj in enumerate(render(cr).objects):
        if obj["kind"] in ("StatefulSet", "Deployment"):
            role = obj["metadata"]["labels"][names.LABEL_ROLE]
            out[role] = _served(obj, 100 + i, copy.deepcopy(status))
    return out


def _status(cr: dict[str, Any], sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The status publish() writes from these workloads (summarize with the CR's desired replicas)."""
    statefulsets = {r: sets.get(r) for r in names.ROLES}
    return summarize(
        Observed(statefulsets=statefulsets, router=sets.get("router")),
        cr_name=cr["metadata"]["name"],
        namespace=NS,
        generation=3,
        revision=render(cr).revision,
        desired=desired_replicas(Inference.of(cr), statefulsets),
        router_replicas=1,
        previous={},
        now="t",
    )


STATUSES = [
    {},  # just created: the controller has written nothing yet
    {"observedGeneration": 1, "replicas": 1, "readyReplicas": 0},  # not yet observed
    {"observedGeneration": 2, "replicas": 3, "readyReplicas": 3, "updatedReplicas": 3},
    {
        "observedGeneration": 2,
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 1,
        "currentRevision": "a",
        "updateRevision": "b",
    },
]


@pytest.mark.parametrize("autoscaled", [False, True])
@pytest.mark.parametrize("status", STATUSES)
def test_the_trimmed_workload_gives_the_status_of_the_whole_object(status: dict, autoscaled: bool) -> None:
    cr = _cr(autoscaled)
    full = _workloads(cr, status)
    trimmed = {role: handlers.watched_copy(obj) for role, obj in full.items()}
    assert _status(cr, trimmed) == _status(cr, full)
    assert desired_replicas(Inference.of(cr), trimmed) == desired_replicas(Inference.of(cr), full)
    # the autoscaler's and newer()'s reads
    for role, obj in full.items():
        small = trimmed[role]
        assert small["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]
        assert small["spec"].get("replicas") == obj["spec"].get("replicas")
        assert small.get("status", {}).get("readyReplicas") == obj["status"].get("readyReplicas")
        older = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
        assert newer(older, small) is small and newer(small, older) is small


def test_a_changed_template_revision_still_shows_in_the_trimmed_copy() -> None:
    cr = _cr()
    full = _workloads(cr, STATUSES[2])
    full["decode"]["spec"]["template"]["metadata"]["labels"][names.LABEL_REVISION] = "old"
    trimmed = {role: handlers.watched_copy(obj) for role, obj in full.items()}
    shown = _status(cr, trimmed)
    assert shown == _status(cr, full)
    assert "decode" in json.dumps(shown["conditions"])  # decode is rolling out: the copy kept it


def test_the_trimmed_workload_is_a_small_fraction_and_shares_nothing_with_the_body() -> None:
    full = _workloads(_cr(), STATUSES[2])["prefill"]
    small = handlers.watched_copy(full)
    assert len(json.dumps(small)) * 5 < len(json.dumps(full))
    small["status"]["readyReplicas"] = -1
    assert full["status"]["readyReplicas"] == 3


def test_packed_copies_unpack_to_what_was_indexed() -> None:
    cr = _cr()
    index = {(NS, "big"): [packed.pack(cr)]}
    assert handlers.cr_of(index, (NS, "big")) == cr
    assert handlers.cr_of(index, (NS, "other")) is None and handlers.cr_of(index, None) is None
    sts = _workloads(cr, STATUSES[2])["prefill"]
    copies = {(NS, "big", "StatefulSet", sts["metadata"]["name"]): [packed.pack(sts)]}
    stored = handlers.stored_by(copies, cr)
    assert stored("StatefulSet", sts["metadata"]["name"]) == sts
    assert stored("StatefulSet", "missing") is None
    assert len(packed.pack(sts)) * 3 < len(json.dumps(sts, separators=(",", ":")))
