"""A CR never takes over an object of a name it renders that it does not control: the object is left as
it is (no apply, no owner reference, so the garbage collector never deletes it with the CR) and the CR
reports Degraded=Conflict naming it."""

from __future__ import annotations

import json

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until


def test_a_foreign_object_of_a_rendered_name_is_reported_and_left_alone(cluster, operator) -> None:
    cluster.core.create_namespaced_config_map(
        cluster.ns, {"metadata": {"name": "victim-config"}, "data": {"owner": "team-b"}}
    )
    cluster.core.create_namespaced_service(
        cluster.ns,
        {"metadata": {"name": "victim"}, "spec": {"selector": {"app": "b"}, "ports": [{"port": 9}]}},
    )
    cluster.apply(make_inference("victim").obj())
    degraded = lambda: cluster.condition("victim", "Degraded").get("reason")  # noqa: E731
    wait_until(lambda: degraded() == "Conflict", "Degraded=Conflict")
    message = cluster.condition("victim", "Degraded")["message"]
    assert "ConfigMap victim-config" in message and "Service victim " in message, message
    assert cluster.condition("victim", "Ready")["status"] == "False"
    wait_until(lambda: cluster.get("statefulset", "victim-decode"), "the CR's own objects applied")
    for kind, name in (("configmap", "victim-config"), ("service", "victim")):
        obj = json.loads(cluster.kubectl("get", kind, name, "-o", "json", "--show-managed-fields").stdout)
        assert not obj["metadata"].get("ownerReferences"), (kind, obj["metadata"])
        assert all(m["manager"] != "kvferry" for m in obj["metadata"]["managedFields"]), kind
    assert cluster.get("configmap", "victim-config")["data"] == {"owner": "team-b"}
    assert cluster.get("service", "victim")["spec"]["ports"][0]["port"] == 9
    assert cluster.events("Conflict")

    cluster.kubectl("delete", "disaggregatedinference", "victim", "--wait=true", "--timeout=30s")
    wait_until(lambda: not cluster.get("statefulset", "victim-decode"), "the CR's own objects collected", 90)
    assert cluster.get("configmap", "victim-config") and cluster.get("service", "victim")
