"""spec.<role>.efaAttach dra: GPUs and EFA devices as one DRA claim per pod, each GPU's EFA on its PCIe root.

Device plugins hand out `nvidia.com/gpu` and `vpc.amazonaws.com/efa` as independent counts; a pod that takes
part of a node (TP2 on p5en: 2 GPUs, 4 EFA) gets EFA devices next to its GPUs only where the AMI aligns
them (EKS "Manage EFA devices": EKS-optimized AL2023 accelerated AMIs only). With Dynamic Resource
Allocation the alignment is the claim's to state. Facts used (docs/eks-dra.md cites each):

- The EFA DRA driver (DRANET, driver `dra.net`) publishes EFA devices in ResourceSlices; its chart
  `eks/aws-dranet` installs the DeviceClass `efa.networking.k8s.aws` (EKS user guide, "Manage EFA
  devices"; kubernetes-sigs/dranet "AWS EKS with GPUDirect and EFA").
- The NVIDIA GPU DRA driver's DeviceClass is `gpu.nvidia.com`; both drivers publish the standard attribute
  `resource.kubernetes.io/pcieRoot` (kubernetes.io "Standard Device Attributes for DRA"; the dranet page),
  so `matchAttribute` on it co-locates a GPU and an EFA device under one PCIe root complex.

One request pair per GPU: `gpu-<i>` (one GPU) and `efa-<i>` (its share of the pod's EFA devices) with a
constraint on the pair alone. A single constraint over all of a pod's devices would demand one root for
every GPU, which p5en (one GPU per root) can never give a TP2 pod.
"""

from __future__ import annotations

import json
from typing import Any

from kvferry.operator.spec import names

API_VERSION = "resource.k8s.io/v1"  # DRA is GA since Kubernetes 1.34
GPU_CLASS = "gpu.nvidia.com"
EFA_CLASS = "efa.networking.k8s.aws"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
CLAIM_NAME = "devices"  # the pod's resourceClaims entry and the container's resources.claims name
# The extended resources a DRA claim replaces in the container's requests and limits.
REPLACED_RESOURCES = ("nvidia.com/gpu", "vpc.amazonaws.com/efa")
# resource.k8s.io/v1 limits (k8s.io/api resource/v1 types.go): requests and constraints per claim, and
# devices in one allocation result.
MAX_REQUESTS = 32
MAX_ALLOCATED = 32


class DraError(ValueError):
    """A role whose devices cannot be put in one claim."""


def efa_shares(gpus: int, efa: int) -> list[int]:
    """EFA devices per GPU: as even as they go, the first GPUs taking the remainder."""
    if gpus <= 0:
        return []
    base, extra = divmod(efa, gpus)
    return [base + (1 if i < extra else 0) for i in range(gpus)]


def claim_spec(gpus: int, efa: int) -> dict[str, Any]:
    """The ResourceClaim spec of one pod: `gpus` GPUs, `efa` EFA devices, each share on its GPU's root."""
    if gpus + efa > MAX_ALLOCATED:
        raise DraError(
            f"{gpus} GPUs + {efa} EFA devices is more than the {MAX_ALLOCATED} devices one DRA claim can be "
            "allocated (resource.k8s.io/v1); lower this role's efa or use efaAttach devicePlugin"
        )
    requests: list[dict[str, Any]] = []
    constraints: list[dict[str, Any]] = []
    for i, share in enumerate(efa_shares(gpus, efa)):
        requests.append({"name": f"gpu-{i}", "exactly": {"deviceClassName": GPU_CLASS, "count": 1}})
        if share:
            requests.append({"name": f"efa-{i}", "exactly": {"deviceClassName": EFA_CLASS, "count": share}})
            constraints.append({"requests": [f"gpu-{i}", f"efa-{i}"], "matchAttribute": PCIE_ROOT})
    if not gpus and efa:  # no GPU to align with: the EFA devices alone
        requests.append({"name": "efa", "exactly": {"deviceClassName": EFA_CLASS, "count": efa}})
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {"devices": devices}


def template(role_name: str, namespace: str, labels: dict[str, str], gpus: int, efa: int) -> dict[str, Any]:
    """The role's ResourceClaimTemplate. Its spec is immutable once created, so its name carries a hash
    of the spec: a changed claim (another TP size, efa count) is a new template the pods move to."""
    spec = claim_spec(gpus, efa)
    digest = names.short_hash(json.dumps(spec, sort_keys=True), 8)
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": names.fit(f"{role_name}-{CLAIM_NAME}-{digest}"),
            "namespace": namespace,
            "labels": labels,
        },
        "spec": {"spec": spec},
    }


def without_replaced(resources: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Container resources with the GPU and EFA counts left to the claim (keeping everything else)."""
    return {
        kind: {k: v for k, v in values.items() if k not in REPLACED_RESOURCES}
        for kind, values in resources.items()
    }
