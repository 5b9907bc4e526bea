"""Fake node shapes: p5en.48xlarge, trn2.48xlarge and a plain CPU node as Node manifests.

Shapes follow shared/reference/efa-k8s.md §1: resource names, EFA counts, the instance-type/zone labels and
the blueprint taints (`nvidia.com/gpu=true:NoSchedule`, `aws.amazon.com/neuron=true:NoSchedule`).
Capacity goes into both capacity and allocatable because the scheduler reads allocatable and no kubelet
is there to fill it. Nodes annotated `kwok.x-k8s.io/node: fake` are run by kwok; a node without it is left
for another agent (the node agent of `kvferry demo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_VALUE = "fake"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
ZONE = "topology.kubernetes.io/zone"
REGION = "topology.kubernetes.io/region"
DEFAULT_ZONE = "us-east-2a"
GPU = "nvidia.com/gpu"
NEURON = "aws.amazon.com/neuron"
NEURONCORE = "aws.amazon.com/neuroncore"
EFA = "vpc.amazonaws.com/efa"
HUGEPAGES_2MI = "hugepages-2Mi"
EFA_HUGEPAGES = "10256Mi"  # the EFA driver pre-allocates 5128 pages of 2 MiB
# EKS labels nodes of instance types with EC2 instance topology (p5en, trn2, ...) with the network node
# above them at each layer, 1 = top, 3 = bottom (EKS user guide, "network topology labels").
NETWORK_LAYERS = tuple(f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3))


@dataclass(frozen=True)
class NodeShape:
    key: str  # short name used in node names and APIs: p5en, trn2, cpu
    instance_type: str
    resources: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()
    network_topology: bool = False  # EKS sets the network-node-layer labels on this instance type


P5EN = NodeShape(
    key="p5en",
    instance_type="p5en.48xlarge",
    resources={
        "cpu": "192",
        "memory": "2048Gi",
        "pods": "110",
        "ephemeral-storage": "28Ti",
        GPU: "8",
        EFA: "16",
        HUGEPAGES_2MI: EFA_HUGEPAGES,
    },
    labels={"nvidia.com/gpu.present": "true", "vpc.amazonaws.com/efa.present": "true"},
    taints=({"key": GPU, "value": "true", "effect": "NoSchedule"},),
    network_topology=True,
)

TRN2 = NodeShape(
    key="trn2",
    instance_type="trn2.48xlarge",
    resources={
        "cpu": "192",
        "memory": "2048Gi",
        "pods": "110",
        "ephemeral-storage": "1900Gi",
        NEURON: "16",
        NEURONCORE: "64",  # 16 devices x 8 physical cores at the default LNC=2
        EFA: "16",
        HUGEPAGES_2MI: EFA_HUGEPAGES,
    },
    labels={"aws.amazon.com/neuron.present": "true", "vpc.amazonaws.com/efa.present": "true"},
    taints=({"key": NEURON, "value": "true", "effect": "NoSchedule"},),
    network_topology=True,
)

CPU = NodeShape(
    key="cpu",
    instance_type="m7i.2xlarge",
    resources={"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"},
)

SHAPES = {s.key: s for s in (P5EN, TRN2, CPU)}
DEFAULT_COUNTS = {"p5en": 2, "trn2": 1, "cpu": 1}


def shape(key: str) -> NodeShape:
    if key not in SHAPES:
        raise ValueError(f"unknown node shape {key!r}; known: {', '.join(SHAPES)}")
    return SHAPES[key]


def node_name(shape_key: str, index: int) -> str:
    return f"{shape_key}-{index}"


def network_nodes(zone: str, spine: int) -> tuple[str, str, str]:
    """Network node ids of layers 1-3 for a node under bottom-layer node `spine` of `zone`, in the
    `nn-<hex>` form EKS uses; nodes of one zone share layers 1 and 2."""
    return (f"nn-{zone}-1", f"nn-{zone}-2", f"nn-{zone}-3-{spine}")


def manifest(
    s: NodeShape,
    index: int,
    *,
    kwok: bool = True,
    zone: str = DEFAULT_ZONE,
    network: tuple[str, str, str] | None = None,
) -> dict[str, Any]:
    """A v1 Node for shape `s`; `kwok=False` leaves it unannotated so kwok does not run it.

    network: its layer-1..3 network nodes; unset: two nodes per bottom-layer node, on shapes EKS labels.
    """
    name = node_name(s.key, index)
    if network is None and s.network_topology:
        network = network_nodes(zone, index // 2)
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok" if kwok else "agent",
        INSTANCE_TYPE: s.instance_type,
        ZONE: zone,
        REGION: zone[:-1],
        **dict(zip(NETWORK_LAYERS, network or (), strict=False)),
        **s.labels,
    }
    annotations = {KWOK_ANNOTATION: KWOK_VALUE} if kwok else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {"taints": [dict(t) for t in s.taints]},
        "status": {"capacity": dict(s.resources), "allocatable": dict(s.resources)},
    }


def manifests(counts: dict[str, int] | None = None, *, kwok_cpu: bool = True) -> list[dict[str, Any]]:
    """Nodes for `counts` ({shape: n}); `kwok_cpu=False` leaves the cpu nodes to another agent."""
    out = []
    for key, n in (DEFAULT_COUNTS if counts is None else counts).items():
        s = shape(key)
        if n < 0:
            raise ValueError(f"node count for {key!r} must be >= 0, got {n}")
        out += [manifest(s, i, kwok=kwok_cpu or key != "cpu") for i in range(n)]
    return out
