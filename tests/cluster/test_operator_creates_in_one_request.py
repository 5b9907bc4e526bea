"""Requests per reconcile cut to what the objects need (issue 19): on the real API server, an apply for a
name the watch has never seen creates the object in one request (a server-side apply carrying a
resourceVersion no stored object has), and can never merge into an object that holds the name: someone
else's is refused and left as it was, the CR's own (the watch was behind) is applied as usual."""

from __future__ import annotations

import copy
import json

import pytest
from kvferry.operator.reconcile.apply import NotControlled
from kvferry.operator.render.objects import render

from tests.cluster.operator_fixtures import OPERATOR_NAMESPACE
from tests.unit.operator.cases import make_inference


def _rendered(cluster, name: str) -> dict[tuple[str, str], dict]:
    cluster.apply(make_inference(name).obj())  # no operator runs here: nothing else writes
    objs = render(cluster.cr(name), operator_namespace=OPERATOR_NAMESPACE).objects
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _new_requests(kube, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in kube.requests.items() if v != before.get(k, 0)}


def test_an_unseen_name_is_created_in_one_request(cluster, operator_kube) -> None:
    cm = _rendered(cluster, "once")[("ConfigMap", "once-config")]
    before = dict(operator_kube.requests)
    stored = operator_kube.apply(cm, absent=True)
    assert _new_requests(operator_kube, before) == {"PATCH ConfigMap": 1}  # no read
    assert stored["data"] == cm["data"] and cluster.get("configmap", "once-config")["data"] == cm["data"]

    again = copy.deepcopy(cm)  # the watch was behind: the object is ours and exists
    again["data"] = {**cm["data"], "extra": "1"}
    before = dict(operator_kube.requests)
    operator_kube.apply(again, absent=True)
    assert cluster.get("configmap", "once-config")["data"]["extra"] == "1"
    assert _new_requests(operator_kube, before)["GET ConfigMap"] == 1  # the 409 sent it to read + check


def test_someone_elses_object_of_an_unseen_name_is_refused_and_left_alone(cluster, operator_kube) -> None:
    svc = _rendered(cluster, "theirs")[("Service", "theirs-prefill")]
    cluster.core.create_namespaced_service(
        cluster.ns,
        {"metadata": {"name": "theirs-prefill"}, "spec": {"selector": {"app": "b"}, "ports": [{"port": 9}]}},
    )
    with pytest.raises(NotControlled, match="Service theirs-prefill exists and is not"):
        operator_kube.apply(svc, absent=True)
    obj = json.loads(
        cluster.kubectl("get", "service", "theirs-prefill", "-o", "json", "--show-managed-fields").stdout
    )
    assert not obj["metadata"].get("ownerReferences")
    assert all(m["manager"] != "kvferry" for m in obj["metadata"]["managedFields"])
    assert obj["spec"]["selector"] == {"app": "b"} and obj["spec"]["ports"][0]["port"] == 9
