"""Proof that the local control plane is a real API server: CEL, printer columns, RBAC, GC, kubectl, helm."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from kvferry.local.controlplane import ControlPlane, versions

from tests.waiting import wait_until

CEL_MESSAGE = "minReplicas must not exceed maxReplicas"


def _widget_crd(group: str) -> dict:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "required": ["minReplicas", "maxReplicas"],
                "properties": {"minReplicas": {"type": "integer"}, "maxReplicas": {"type": "integer"}},
                "x-kubernetes-validations": [
                    {"rule": "self.minReplicas <= self.maxReplicas", "message": CEL_MESSAGE}
                ],
            },
            "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
        },
    }
    columns = [
        {"name": "Min", "type": "integer", "jsonPath": ".spec.minReplicas"},
        {"name": "Max", "type": "integer", "jsonPath": ".spec.maxReplicas"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    ]
    version = {
        "name": "v1",
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}},
        "additionalPrinterColumns": columns,
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [version],
        },
    }


@pytest.fixture
def widget_group(admin_api) -> str:
    ext = client.ApiextensionsV1Api(admin_api)
    group = f"t{uuid.uuid4().hex[:6]}.test.kvferry.io"
    ext.create_custom_resource_definition(_widget_crd(group))

    def established() -> bool:
        crd = ext.read_custom_resource_definition(f"widgets.{group}")
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    wait_until(established, f"CRD widgets.{group} Established", 30, ignore=(ApiException,))
    yield group
    ext.delete_custom_resource_definition(f"widgets.{group}")


def _widget(name: str, lo: int, hi: int) -> dict:
    return {"kind": "Widget", "metadata": {"name": name}, "spec": {"minReplicas": lo, "maxReplicas": hi}}


def test_cel_rule_rejects_invalid_object_with_its_message(admin_api, namespace, widget_group):
    objs = client.CustomObjectsApi(admin_api)
    body = {**_widget("bad", 5, 2), "apiVersion": f"{widget_group}/v1"}
    with pytest.raises(ApiException) as err:
        objs.create_namespaced_custom_object(widget_group, "v1", namespace, "widgets", body)
    assert err.value.status == 422
    assert CEL_MESSAGE in json.loads(err.value.body)["message"]
    good = {**_widget("good", 1, 3), "apiVersion": f"{widget_group}/v1"}
    created = objs.create_namespaced_custom_object(widget_group, "v1", namespace, "widgets", good)
    assert created["spec"] == {"minReplicas": 1, "maxReplicas": 3}


def test_kubectl_get_prints_custom_columns(control_plane: ControlPlane, admin_api, namespace, widget_group):
    objs = client.CustomObjectsApi(admin_api)
    body = {**_widget("shown", 2, 7), "apiVersion": f"{widget_group}/v1"}
    objs.create_namespaced_custom_object(widget_group, "v1", namespace, "widgets", body)
    status = {"status": {"phase": "Serving"}}
    objs.patch_namespaced_custom_object_status(widget_group, "v1", namespace, "widgets", "shown", status)
    out = control_plane.kubectl("get", f"widgets.{widget_group}", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "MIN", "MAX", "PHASE"]  # custom columns replace AGE
    assert out[1].split() == ["shown", "2", "7", "Serving"]


def test_kubectl_and_server_report_the_pinned_version(control_plane: ControlPlane):
    info = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert info["serverVersion"]["gitVersion"] == f"v{versions.KUBERNETES}"
    assert info["clientVersion"]["gitVersion"] == f"v{versions.KUBERNETES}"


def test_service_account_without_permission_gets_403(admin_api, sa_client, namespace):
    reader = sa_client(namespace, "reader")
    with pytest.raises(ApiException) as err:
        client.CoreV1Api(reader).list_namespaced_pod(namespace)
    assert err.value.status == 403
    assert f"system:serviceaccount:{namespace}:reader" in err.value.body

    # Granting the permission makes the same token work: RBAC is evaluated, not a blanket refusal.
    rbac = client.RbacAuthorizationV1Api(admin_api)
    rule = client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["list"])
    rbac.create_namespaced_role(
        namespace, client.V1Role(metadata=client.V1ObjectMeta(name="r"), rules=[rule])
    )
    subject = client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)
    ref = client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="r")
    binding = client.V1RoleBinding(metadata=client.V1ObjectMeta(name="r"), role_ref=ref, subjects=[subject])
    rbac.create_namespaced_role_binding(namespace, binding)
    wait_until(
        lambda: client.CoreV1Api(reader).list_namespaced_pod(namespace) is not None,
        "pods list allowed",
        15,
        ignore=(ApiException,),
    )
    with pytest.raises(ApiException) as err:
        client.CoreV1Api(reader).list_namespaced_secret(namespace)
    assert err.value.status == 403


def test_deleting_owner_garbage_collects_dependents(admin_api, namespace):
    core = client.CoreV1Api(admin_api)
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    ref = client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid)
    meta = client.V1ObjectMeta(name="dependent", owner_references=[ref])
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=meta, data={"k": "v"}))
    core.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    def gone() -> bool:
        names = {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}
        return "dependent" not in names

    wait_until(gone, "dependent ConfigMap garbage-collected", 60, ignore=(ApiException,))


def test_helm_install_of_a_trivial_chart(control_plane: ControlPlane, admin_api, namespace, tmp_path: Path):
    chart = tmp_path / "hello"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        f"apiVersion: v2\nname: hello\nversion: 0.1.0\nkubeVersion: '>= 1.{versions.kube_minor()}.0-0'\n"
    )
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-hello\n"
        "data:\n  kubeVersion: {{ .Capabilities.KubeVersion.Version | quote }}\n"
    )
    control_plane.helm("install", "r1", str(chart), "-n", namespace, "--wait", "--timeout", "60s")
    cm = client.CoreV1Api(admin_api).read_namespaced_config_map("r1-hello", namespace)
    assert cm.data == {"kubeVersion": f"v{versions.KUBERNETES}"}
    listed = json.loads(control_plane.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in listed] == [("r1", "deployed")]
    control_plane.helm("uninstall", "r1", "-n", namespace, "--wait")
    assert "r1-hello" not in {
        c.metadata.name for c in client.CoreV1Api(admin_api).list_namespaced_config_map(namespace).items
    }
