"""Proof that the fake nodes behave like the real targets: scheduling by selector, taint and resources."""

from __future__ import annotations

import contextlib
import ipaddress

from kubernetes import client
from kubernetes.client.rest import ApiException
from kvferry.local.controlplane import ControlPlane, nodes
from kvferry.local.controlplane.components import POD_CIDR

from tests.waiting import wait_until

POD_READY_TIMEOUT_S = 60


def _container(resources: dict[str, str]) -> client.V1Container:
    # Extended resources and hugepages need requests == limits; hugepages also need a cpu/memory request.
    reqs = client.V1ResourceRequirements(requests=resources, limits=resources)
    return client.V1Container(name="main", image="example.invalid/none:0", resources=reqs)


def _pod_spec(instance_type: str, toleration_key: str | None, resources: dict[str, str]) -> client.V1PodSpec:
    tolerations = [client.V1Toleration(key=toleration_key, operator="Exists", effect="NoSchedule")]
    return client.V1PodSpec(
        containers=[_container(resources)],
        node_selector={nodes.INSTANCE_TYPE: instance_type},
        tolerations=tolerations if toleration_key else None,
    )


def _ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _pods(core: client.CoreV1Api, namespace: str, selector: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(namespace, label_selector=selector).items


def test_statefulset_lands_on_p5en_nodes_and_becomes_ready(admin_api, namespace):
    core, apps = client.CoreV1Api(admin_api), client.AppsV1Api(admin_api)
    labels = {"app": "prefill"}
    core.create_namespaced_service(
        namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name="prefill"),
            spec=client.V1ServiceSpec(
                cluster_ip="None", selector=labels, ports=[client.V1ServicePort(port=8000)]
            ),
        ),
    )
    # Each replica asks for a whole p5en (8 GPUs, 16 EFA): two replicas must land on two different nodes.
    resources = {"cpu": "4", "memory": "16Gi", nodes.GPU: "8", nodes.EFA: "16", nodes.HUGEPAGES_2MI: "5120Mi"}
    template = client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels=labels), spec=_pod_spec("p5en.48xlarge", nodes.GPU, resources)
    )
    spec = client.V1StatefulSetSpec(
        replicas=2,
        service_name="prefill",
        selector=client.V1LabelSelector(match_labels=labels),
        template=template,
    )
    apps.create_namespaced_stateful_set(
        namespace, client.V1StatefulSet(metadata=client.V1ObjectMeta(name="prefill"), spec=spec)
    )

    def all_ready() -> bool:
        sts = apps.read_namespaced_stateful_set("prefill", namespace)
        return (sts.status.ready_replicas or 0) == 2

    wait_until(all_ready, "StatefulSet prefill 2/2 ready", POD_READY_TIMEOUT_S, ignore=(ApiException,))
    pods = _pods(core, namespace, "app=prefill")
    assert sorted(p.metadata.name for p in pods) == ["prefill-0", "prefill-1"]
    assert sorted(p.spec.node_name for p in pods) == ["p5en-0", "p5en-1"]
    for p in pods:
        assert _ready(p) and p.status.phase == "Running"
        assert ipaddress.ip_address(p.status.pod_ip) in ipaddress.ip_network(POD_CIDR)


def test_neuron_pod_lands_on_trn2_and_untolerated_pod_stays_pending(admin_api, namespace):
    core = client.CoreV1Api(admin_api)
    resources = {"cpu": "8", "memory": "64Gi", nodes.NEURON: "16", nodes.EFA: "16"}
    for name, toleration in (("neuron", nodes.NEURON), ("no-toleration", None)):
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, labels={"probe": name}),
            spec=_pod_spec("trn2.48xlarge", toleration, resources),
        )
        core.create_namespaced_pod(namespace, pod)

    wait_until(
        lambda: _ready(core.read_namespaced_pod("neuron", namespace)),
        "pod neuron Ready",
        POD_READY_TIMEOUT_S,
        ignore=(ApiException,),
    )
    assert core.read_namespaced_pod("neuron", namespace).spec.node_name == "trn2-0"

    def unschedulable() -> bool:
        conds = core.read_namespaced_pod("no-toleration", namespace).status.conditions or []
        return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conds)

    wait_until(
        unschedulable,
        "scheduler reports no-toleration Unschedulable",
        POD_READY_TIMEOUT_S,
        ignore=(ApiException,),
    )
    pod = core.read_namespaced_pod("no-toleration", namespace)
    assert pod.spec.node_name is None and pod.status.phase == "Pending"
    message = next(c.message for c in pod.status.conditions if c.type == "PodScheduled")
    assert "untolerated taint" in message


def test_node_without_kwok_annotation_is_left_to_another_agent(
    control_plane: ControlPlane, admin_api, namespace
):
    core = client.CoreV1Api(admin_api)
    managed, agent = nodes.manifest(nodes.CPU, 8, kwok=True), nodes.manifest(nodes.CPU, 9, kwok=False)
    names = [managed["metadata"]["name"], agent["metadata"]["name"]]
    try:
        for body in (managed, agent):
            core.create_node(body)
        control_plane.wait_nodes_ready([names[0]], 60)
        # Bind one pod to each node directly (no scheduler): only the kwok-run node's pod may start.
        for node in names:
            spec = client.V1PodSpec(node_name=node, containers=[_container({"cpu": "1"})])
            core.create_namespaced_pod(
                namespace, client.V1Pod(metadata=client.V1ObjectMeta(name=node), spec=spec)
            )
        wait_until(
            lambda: _ready(core.read_namespaced_pod(names[0], namespace)),
            "pod on the kwok node Ready",
            60,
            ignore=(ApiException,),
        )
        left = core.read_namespaced_pod(names[1], namespace)
        assert left.status.phase == "Pending" and not left.status.pod_ip
        conds = {c.type: c.status for c in core.read_node(names[1]).status.conditions or []}
        assert conds.get("Ready") != "True"
    finally:
        for name in names:  # no kubelet on the agent node confirms deletion: force it, as for a lost node
            with contextlib.suppress(ApiException):  # absent if the test failed before creating it
                core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            core.delete_node(name)
