"""What a CR's pods need from a cluster, read from its render (what the operator would create)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvferry.operator.render import dra
from kvferry.operator.render.objects import render
from kvferry.operator.spec import names

GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
NEURON = "aws.amazon.com/neuron"
DEVICE_RESOURCES = (GPU, EFA, NEURON)


@dataclass(frozen=True)
class RoleNeeds:
    role: str
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    devices: dict[str, int]  # extended resource -> count per pod (device plugins)
    dra_claim: bool  # GPUs and EFA from a ResourceClaim (efaAttach dra)
    scheduler_name: str | None
    images: list[str]


@dataclass(frozen=True)
class Needs:
    name: str
    namespace: str
    accelerator: str
    roles: list[RoleNeeds]
    lws: bool  # a role spans nodes: LeaderWorkerSet
    kueue: bool  # spec.placement.gang kueue
    labels: dict[str, str] = field(default_factory=dict)  # selects the CR's pods


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "LeaderWorkerSet":
        spec: dict[str, Any] = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        return spec
    spec = obj["spec"]["template"]["spec"]
    return spec


def needs_of(cr: dict[str, Any]) -> Needs:
    """Render `cr` (raises spec.SpecError as the API server would refuse it) and read its pods' needs."""
    rendered = render(cr)
    meta = cr.get("metadata", {})
    roles, lws = [], False
    for obj in rendered.objects:
        if obj["kind"] not in ("StatefulSet", "LeaderWorkerSet"):
            continue
        lws = lws or obj["kind"] == "LeaderWorkerSet"
        pod = _pod_spec(obj)
        container = pod["containers"][0]
        requests = container.get("resources", {}).get("requests", {})
        roles.append(
            RoleNeeds(
                role=obj["metadata"]["labels"][names.LABEL_ROLE],
                node_selector=dict(pod.get("nodeSelector", {})),
                tolerations=list(pod.get("tolerations", [])),
                devices={k: int(v) for k, v in requests.items() if k in DEVICE_RESOURCES and int(v) > 0},
                dra_claim=any(c.get("name") == dra.CLAIM_NAME for c in pod.get("resourceClaims", [])),
                scheduler_name=pod.get("schedulerName"),
                images=[c["image"] for c in [*pod.get("initContainers", []), *pod["containers"]]],
            )
        )
    spec = rendered.spec
    return Needs(
        name=meta.get("name", ""),
        namespace=meta.get("namespace") or "default",
        accelerator=spec.accelerator,
        roles=roles,
        lws=lws,
        kueue=spec.placement.gang == "kueue",
        labels={names.LABEL_NAME: meta.get("name", "")},
    )
