"""Reconcile once per change (issue 19): a reconcile writes only objects whose watched copy differs from
the render, creates unseen ones in one request, and still never writes over an object it does not
control; workload events that move nothing are sorted out before any render."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kvferry.operator.fleet.changes import Change, Changes
from kvferry.operator.reconcile import steps
from kvferry.operator.reconcile.apply import NotControlled, not_ours
from kvferry.operator.reconcile.drift import up_to_date
from kvferry.operator.render.objects import render
from kvferry.operator.runtime.config import OperatorConfig, check_shard
from kvferry.operator.runtime.shard import owns, shard_of
from kvferry.operator.spec import Inference, names

from tests.unit.operator.cases import make_inference

CFG = OperatorConfig()


class CountingKube:
    """Stores what is applied (as the API server would echo it) and counts each call by kind."""

    def __init__(self, cr: dict[str, Any]) -> None:
        self.cr, self.objects, self.rv = cr, {}, 10
        self.applies: list[tuple[str, str, bool]] = []  # (kind, name, absent hint)
        self.foreign: set[tuple[str, str]] = set()

    def apply(self, obj: dict[str, Any], *, absent: bool = False) -> dict[str, Any]:
        key = (obj["kind"], obj["metadata"]["name"])
        self.applies.append((*key, absent))
        if key in self.foreign:
            raise NotControlled(f"{key[0]} {key[1]} exists and is not this CR's")
        self.rv += 1
        stored = copy.deepcopy(obj)
        stored["metadata"] |= {"resourceVersion": str(self.rv), "uid": f"uid-{key[1]}", "generation": 1}
        if obj["kind"] in ("StatefulSet", "Deployment"):
            n = obj["spec"].get("replicas", 1)
            stored["status"] = {
                "observedGeneration": 1,
                "replicas": n,
                "readyReplicas": n,
                "updatedReplicas": n,
            }
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.cr if kind == "DisaggregatedInference" else self.objects.get((kind, name)))

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        return True

    def create_owned(self, obj: dict[str, Any], owner_uid: str) -> bool:  # the transfer token Secret
        return False

    def serves(self, group: str) -> bool:
        return False  # no optional API groups installed

    def patch_status(self, namespace: str, name: str, patch: dict, resource_version: str | None) -> dict:
        self.rv += 1
        self.cr["status"] = {**(self.cr.get("status") or {}), **copy.deepcopy(patch)}
        self.cr["metadata"]["resourceVersion"] = str(self.rv)
        return copy.deepcopy(self.cr)

    def stored(self, kind: str, name: str) -> dict[str, Any] | None:
        """What a watch would hold: the stored copies."""
        return copy.deepcopy(self.objects.get((kind, name)))


def _cr() -> dict[str, Any]:
    cr = make_inference("x", namespace="ns").obj()
    cr["metadata"] |= {"uid": "cr-uid", "generation": 1, "resourceVersion": "1"}
    return cr


def _reconcile(kube: CountingKube, trigger: str) -> steps.Outcome:
    return steps.reconcile(
        kube, Inference.of(copy.deepcopy(kube.cr)), CFG, trigger=trigger, stored=kube.stored
    )


def test_first_reconcile_creates_each_object_in_one_request_then_nothing_is_rewritten() -> None:
    kube = CountingKube(_cr())
    rendered = render(kube.cr).objects
    _reconcile(kube, "create")
    assert [(k, n) for k, n, _ in kube.applies] == [(o["kind"], o["metadata"]["name"]) for o in rendered]
    assert all(absent for _, _, absent in kube.applies)  # the watch had none: create without a read
    kube.applies.clear()
    out = _reconcile(kube, "resume")
    assert kube.applies == [] and out.skipped == len(rendered)
    assert kube.cr["status"]["prefill"]["readyReplicas"] == 1  # status read from the watched copies


def test_only_the_object_that_differs_is_applied_and_drift_applies_everything() -> None:
    kube = CountingKube(_cr())
    _reconcile(kube, "create")
    kube.applies.clear()
    cm = ("ConfigMap", names.config_name("x"))
    kube.objects[cm]["data"] = {"edited": "by hand"}
    _reconcile(kube, "update")
    assert [(k, n, a) for k, n, a in kube.applies] == [(*cm, False)]  # differs: read + conditional apply
    kube.applies.clear()
    pdb = ("PodDisruptionBudget", "x-decode")  # a kind with no event handler: the resync catches it
    kube.objects[pdb]["spec"]["maxUnavailable"] = 7
    _reconcile(kube, "resync")
    assert [(k, n) for k, n, _ in kube.applies] == [pdb]
    kube.applies.clear()
    _reconcile(kube, "drift")
    assert len(kube.applies) == len(render(kube.cr).objects)  # a drift correction trusts no copy


def test_a_watched_copy_the_cr_does_not_control_is_never_skipped_nor_taken_over() -> None:
    kube = CountingKube(_cr())
    _reconcile(kube, "create")
    svc = ("Service", "x-prefill")
    kube.objects[svc]["metadata"]["ownerReferences"] = [
        {"kind": "Other", "name": "y", "uid": "u2", "controller": True}
    ]
    kube.foreign.add(svc)
    kube.applies.clear()
    out = _reconcile(kube, "update")
    assert [(k, n) for k, n, _ in kube.applies] == [svc]
    assert "Service x-prefill" in out.conflict


def test_up_to_date_sees_labels_annotations_and_fields_outside_spec() -> None:
    obj = next(o for o in render(_cr()).objects if o["kind"] == "RoleBinding")
    stored = copy.deepcopy(obj)
    assert up_to_date(obj, stored) and not_ours(stored, obj) is None
    stored["subjects"][0]["name"] = "someone-else"
    assert not up_to_date(obj, stored)
    stored = copy.deepcopy(obj)
    stored["metadata"]["labels"][names.LABEL_MANAGED_BY] = "other"
    assert not up_to_date(obj, stored)


def _sts(
    status: dict[str, Any], replicas: int = 1, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    meta = {"uid": "s1", "labels": {"a": "b"}, "annotations": annotations or {}, "resourceVersion": "9"}
    return {"kind": "StatefulSet", "metadata": meta, "spec": {"replicas": replicas}, "status": status}


def test_workload_events_are_sorted_by_what_they_moved() -> None:
    seen = Changes()
    assert seen.note(_sts({"readyReplicas": 0}), None) is Change.NONE  # the initial listing
    assert seen.note(_sts({"readyReplicas": 0}), "MODIFIED") is Change.NONE  # resourceVersion only
    assert seen.note(_sts({"readyReplicas": 1}), "MODIFIED") is Change.REFRESH
    assert seen.note(_sts({"readyReplicas": 1}, replicas=3), "MODIFIED") is Change.CHECK
    assert seen.note(_sts({"readyReplicas": 1}, 3, {"x": "y"}), "MODIFIED") is Change.CHECK
    assert seen.note(_sts({}), "DELETED") is Change.RECONCILE
    assert len(seen) == 0  # a deleted object is forgotten
    assert Changes().note(_sts({}), "MODIFIED") is Change.CHECK  # never seen: compare with the render


def test_shards_split_every_cr_between_exactly_one_replica() -> None:
    crs = [(f"ns{i % 7}", f"cr-{i}") for i in range(500)]
    for count in (1, 2, 3):
        owners = [[i for i in range(count) if owns(ns, name, i, count)] for ns, name in crs]
        assert all(len(o) == 1 for o in owners)
        sizes = [sum(o == [i] for o in owners) for i in range(count)]
        assert min(sizes) > 500 / count * 0.7, sizes  # CRC-32 spreads names evenly enough
    assert shard_of("bench", "b-000", 2) == shard_of("bench", "b-000", 2)  # stable across calls


@pytest.mark.parametrize("bad", ["2/2", "1/0", "a/2", "1", "-1/2"])
def test_a_bad_shard_is_refused_naming_the_setting(bad: str) -> None:
    with pytest.raises(ValueError, match="shard"):
        check_shard(bad)
    with pytest.raises(ValueError, match="KVFERRY_SHARD"):
        OperatorConfig.from_env({"KVFERRY_SHARD": bad})


def test_sharded_replicas_elect_leaders_in_separate_peerings() -> None:
    names_ = {OperatorConfig(shard=f"{i}/2").peering_name for i in range(2)}
    assert len(names_) == 2 and OperatorConfig().peering_name == "kvferry"


def test_a_replica_marks_only_its_own_shards_crs_as_handled_and_keeps_its_own_finalizer() -> None:
    import kopf
    from kvferry.operator.runtime.handlers import ShardDiffBaseStorage, shard_finalizer

    crs = [("ns", f"cr-{i}") for i in range(20)]
    for index in (0, 1):
        storage = ShardDiffBaseStorage(index, 2, prefix="kvferry.io")
        for ns, name in crs:
            patch = kopf.Patch()
            body = kopf.Body({"metadata": {"namespace": ns, "name": name, "annotations": {}}})
            storage.store(body=body, patch=patch, essence={"spec": {}})
            # another shard's CR stays unmarked, so its owner still sees it as new and creates it
            assert bool((patch.get("metadata") or {}).get("annotations")) == owns(ns, name, index, 2)
    assert shard_finalizer(0, 1) == "kvferry.io/finalizer"
    assert len({shard_finalizer(i, 2) for i in range(2)}) == 2
