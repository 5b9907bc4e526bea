"""A CR never takes over an object of a name it renders that it does not control: the object is left as
it is (no apply, no owner reference, so the garbage collector never deletes it with the CR) and the CR
reports Degraded=Conflict naming it."""

from __future__ import annotations

import json

from kvferry.operator.reconcile import steps
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import Inference

from tests.cluster.operator_fixtures import OPERATOR_NAMESPACE
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


def _before_apply_of(kube, kind: str, name: str, act) -> list[str]:
    """Run `act` once, right before the operator's client sends the apply of `kind` `name`: after every
    check the reconcile makes, as a second writer racing it would. Returns a list that records the run."""
    fired: list[str] = []
    send = kube._call

    def call(method: str, what: str, path: str, **kw):
        if method == "PATCH" and what == kind and path.endswith(f"/{name}") and not fired:
            fired.append(f"{kind} {name}")
            act()
        return send(method, what, path, **kw)

    kube._call = call
    return fired


def _untouched(cluster, kind: str, name: str) -> dict:
    obj = json.loads(cluster.kubectl("get", kind, name, "-o", "json", "--show-managed-fields").stdout)
    assert not obj["metadata"].get("ownerReferences"), (kind, obj["metadata"])
    assert all(m["manager"] != "kvferry" for m in obj["metadata"]["managedFields"]), obj["metadata"]
    return obj


def test_an_object_created_or_replaced_between_check_and_apply_is_not_taken_over(
    cluster, operator_kube
) -> None:
    """The reconcile checks a name, then applies. Whoever creates an object of that name in between
    (absent at the check), or replaces ours with theirs (ours at the check), keeps it as it is."""
    cluster.apply(make_inference("race", accelerator="p5en").obj())
    cfg = OperatorConfig(operator_namespace=OPERATOR_NAMESPACE)
    foreign = {"metadata": {"name": "race-config"}, "data": {"owner": "team-b"}}
    fired = _before_apply_of(
        operator_kube,
        "ConfigMap",
        "race-config",
        lambda: cluster.core.create_namespaced_config_map(cluster.ns, foreign),
    )
    out = steps.reconcile(operator_kube, Inference.of(cluster.cr("race")), cfg, trigger="create")
    assert fired == ["ConfigMap race-config"]
    assert _untouched(cluster, "configmap", "race-config")["data"] == {"owner": "team-b"}
    assert "ConfigMap race-config exists and is not" in out.conflict, out
    assert not out.failed, out.failed
    degraded = cluster.condition("race", "Degraded")
    assert (degraded["reason"], "ConfigMap race-config" in degraded["message"]) == ("Conflict", True)
    # The rest is applied, by server-side apply only: a create by POST would leave fields that a later
    # render drops owned by kvferry's Update entry, and applies would never remove them.
    sts = cluster.kubectl("get", "statefulset", "race-decode", "-o", "json", "--show-managed-fields")
    sts = json.loads(sts.stdout)
    assert sts["metadata"]["ownerReferences"][0]["name"] == "race"
    ours = [m for m in sts["metadata"]["managedFields"] if m["manager"] == "kvferry"]
    assert [m["operation"] for m in ours] == ["Apply"], ours

    def replace_ours() -> None:
        cluster.core.delete_namespaced_service("race", cluster.ns)
        spec = {"selector": {"app": "b"}, "ports": [{"name": "web", "port": 9}]}  # merges with ours
        cluster.core.create_namespaced_service(cluster.ns, {"metadata": {"name": "race"}, "spec": spec})

    assert cluster.get("service", "race")["metadata"]["ownerReferences"][0]["name"] == "race"
    fired = _before_apply_of(operator_kube, "Service", "race", replace_ours)
    out = steps.reconcile(operator_kube, Inference.of(cluster.cr("race")), cfg, trigger="update")
    assert fired == ["Service race"]
    theirs = _untouched(cluster, "service", "race")["spec"]
    assert ([p["port"] for p in theirs["ports"]], theirs["selector"]) == ([9], {"app": "b"})
    assert "Service race exists and is not" in out.conflict and "ConfigMap race-config" in out.conflict, out
    assert "Service race " in cluster.condition("race", "Degraded")["message"]
