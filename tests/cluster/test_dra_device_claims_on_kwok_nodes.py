"""spec.<role>.efaAttach dra on the real kube-scheduler (1.35, DRA GA): fake p5en nodes whose GPUs and EFA
devices the test publishes as ResourceSlices, with `resource.kubernetes.io/pcieRoot` as the NVIDIA GPU DRA
driver and the EFA DRA driver (dra.net) publish it. kwok runs no kubelet plugin, but allocation is the
scheduler's alone (it reads the slices and writes each claim's allocation), so what is proven here is the
placement: each TP2 pod gets 2 GPUs and 4 EFA devices, every GPU's EFA devices on its PCIe root, and a pod
whose free GPUs have no EFA devices on their roots stays Pending with the scheduler's reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvferry.local.controlplane import ControlPlane, nodes
from kvferry.operator.render import dra
from kvferry.operator.render.objects import render

from tests.cluster.operator_fixtures import WAIT_S
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

POOL_LABEL = "kvferry.io/test-pool"
EFA_DRIVER = "dra.net"
GPU_DRIVER = "gpu.nvidia.com"
EFA_PCI_DEVICE = "Elastic Fabric Adapter (EFA)"
# The DeviceClasses the drivers' charts install (the EFA one as kubernetes-sigs/dranet's AWS example shows
# it; the GPU one selects the NVIDIA driver's GPUs).
DEVICE_CLASSES = [
    {
        "apiVersion": dra.API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": dra.EFA_CLASS},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f"device.driver == '{EFA_DRIVER}' && "
                        f"device.attributes['{EFA_DRIVER}'].pciDevice == '{EFA_PCI_DEVICE}'"
                    }
                }
            ]
        },
    },
    {
        "apiVersion": dra.API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": dra.GPU_CLASS},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f"device.driver == '{GPU_DRIVER}' && "
                        f"device.attributes['{GPU_DRIVER}'].type == 'gpu'"
                    }
                }
            ]
        },
    },
]


def root(i: int) -> str:
    return f"pci0000:{0x10 * (i + 1):02x}"  # the `pci<domain>:<bus>` form of the standard attribute


def slices(node: str, efa_roots: list[int]) -> list[dict[str, Any]]:
    """A p5en node's ResourceSlices: GPU i on PCIe root i; EFA device j on root efa_roots[j]."""

    def body(driver: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "apiVersion": dra.API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{driver.replace('.', '-')}"},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }

    gpus = [
        {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}, dra.PCIE_ROOT: {"string": root(i)}}}
        for i in range(8)
    ]
    efas = [
        {
            "name": f"efa-{j}",
            "attributes": {"pciDevice": {"string": EFA_PCI_DEVICE}, dra.PCIE_ROOT: {"string": root(r)}},
        }
        for j, r in enumerate(efa_roots)
    ]
    return [body(GPU_DRIVER, gpus), body(EFA_DRIVER, efas)]


ALIGNED = [i // 2 for i in range(16)]  # p5en: two EFA devices on each GPU's root
HALF = [i // 4 for i in range(16)]  # all 16 EFA devices on the roots of GPUs 0-3; GPUs 4-7 have none


@pytest.fixture
def dra_node(control_plane: ControlPlane, namespace: str) -> Iterator[Callable[[list[int]], str]]:
    """`dra_node(efa_roots)` -> the name of a private p5en node with those ResourceSlices."""
    made: list[str] = []
    for cls in DEVICE_CLASSES:  # cluster-wide, shared by every test that needs them
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(cls))

    def make(efa_roots: list[int]) -> str:
        body = nodes.manifest(nodes.P5EN, 200 + len(made))
        body["metadata"]["name"] = name = f"dra-{namespace}-{len(made)}"[:63]
        body["metadata"]["labels"].update({"kubernetes.io/hostname": name, POOL_LABEL: namespace})
        body["spec"]["taints"].append({"key": POOL_LABEL, "value": namespace, "effect": "NoSchedule"})
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(body))
        patch = json.dumps({"status": body["status"]})
        control_plane.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p", patch)
        control_plane.wait_nodes_ready([name])
        items = slices(name, efa_roots)
        control_plane.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        )
        made.append(name)
        return name

    try:
        yield make
    finally:
        for args in (
            ("delete", "statefulsets", "--all", "--wait=false"),
            ("delete", "pods", "--all", "--grace-period=0", "--force", "--wait=false"),
        ):
            control_plane.kubectl("-n", namespace, *args, check=False)
        for name in made:
            control_plane.kubectl(
                "delete", "resourceslices", f"--field-selector=spec.nodeName={name}", check=False
            )
        if made:
            control_plane.kubectl("delete", "node", *made, "--wait=false", check=False)


def _create_prefill(control_plane: ControlPlane, namespace: str, replicas: int) -> None:
    """The CR's ResourceClaimTemplate and prefill StatefulSet as render() makes them (TP2, efaAttach dra)."""
    cr = (
        make_inference("aligned", accelerator="p5en")
        .prefill(replicas=replicas, tensorParallelSize=2, efaAttach="dra")
        .obj()
    )
    cr["metadata"]["namespace"] = namespace
    for obj in render(cr).objects:
        if obj["kind"] == "ResourceClaimTemplate" and "-prefill-" in obj["metadata"]["name"]:
            control_plane.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(obj))
        if obj["kind"] == "StatefulSet" and obj["metadata"]["name"].endswith("-prefill"):
            pod = obj["spec"]["template"]["spec"]
            assert "nvidia.com/gpu" not in json.dumps(pod["containers"][0]["resources"])
            pod["nodeSelector"] = {**pod.get("nodeSelector", {}), POOL_LABEL: namespace}
            pod["tolerations"] = [*pod.get("tolerations", []), {"key": POOL_LABEL, "operator": "Exists"}]
            control_plane.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(obj))


def _get(control_plane: ControlPlane, namespace: str, kind: str) -> list[dict[str, Any]]:
    return json.loads(control_plane.kubectl("-n", namespace, "get", kind, "-o", "json").stdout)["items"]


def _allocations(control_plane: ControlPlane, namespace: str) -> dict[str, list[tuple[str, str]]]:
    """Claim name -> [(request, device)] of every allocated claim."""
    out = {}
    for claim in _get(control_plane, namespace, "resourceclaims"):
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
        if results:
            out[claim["metadata"]["name"]] = [(r["request"], r["device"]) for r in results]
    return out


def _roots(efa_roots: list[int]) -> dict[str, str]:
    return {f"gpu-{i}": root(i) for i in range(8)} | {f"efa-{j}": root(r) for j, r in enumerate(efa_roots)}


def _unschedulable(pod: dict[str, Any]) -> str | None:
    for c in pod.get("status", {}).get("conditions") or []:
        if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
            return str(c.get("message", ""))
    return None


def test_tp2_pods_get_two_gpus_and_four_efa_on_the_gpus_pcie_roots(control_plane, namespace, dra_node):
    node = dra_node(ALIGNED)
    _create_prefill(control_plane, namespace, replicas=4)  # 4 x (2 GPUs + 4 EFA) = the whole node
    allocs = wait_until(
        lambda: _allocations(control_plane, namespace),
        "4 claims allocated",
        WAIT_S,
        until=lambda a: len(a) == 4,
    )
    pods = wait_until(
        lambda: _get(control_plane, namespace, "pods"),
        "4 pods bound",
        WAIT_S,
        until=lambda ps: len(ps) == 4 and all(p["spec"].get("nodeName") for p in ps),
    )
    assert {p["spec"]["nodeName"] for p in pods} == {node}
    roots, used = _roots(ALIGNED), []
    for claim, devices in allocs.items():
        gpus = [d for r, d in devices if r.startswith("gpu-")]
        efas = [d for r, d in devices if r.startswith("efa-")]
        assert len(gpus) == 2 and len(efas) == 4, (claim, devices)
        for i in range(2):  # request gpu-<i> and efa-<i> (2 devices): one root
            pair = [d for r, d in devices if r in (f"gpu-{i}", f"efa-{i}")]
            assert len(pair) == 3 and len({roots[d] for d in pair}) == 1, (claim, devices)
        used += [d for _, d in devices]
    assert len(used) == len(set(used)) == 24  # every device of the node, none twice


def test_free_gpus_without_efa_on_their_roots_leave_the_pod_pending(control_plane, namespace, dra_node):
    """GPUs 4-7 have no EFA device on their roots: after two pods took GPUs 0-3 (and 8 of 16 EFA), a third
    stays Pending though 4 GPUs and 8 EFA devices are free, and the scheduler says it is the claim."""
    dra_node(HALF)
    _create_prefill(control_plane, namespace, replicas=3)

    def settled() -> list[dict[str, Any]]:
        pods = _get(control_plane, namespace, "pods")
        bound = [p for p in pods if p["spec"].get("nodeName")]
        waiting = [p for p in pods if _unschedulable(p) is not None]
        return waiting if len(pods) == 3 and len(bound) == 2 else []

    (waiting,) = wait_until(settled, "2 pods bound and 1 Unschedulable", WAIT_S)
    message = _unschedulable(waiting) or ""
    assert "cannot allocate all claims" in message, message
    allocs = _allocations(control_plane, namespace)
    gpus = {d for devices in allocs.values() for r, d in devices if r.startswith("gpu-")}
    assert gpus == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}, allocs  # the GPUs that have EFA on their roots
