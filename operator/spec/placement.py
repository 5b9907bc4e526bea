"""The spec's placement section: where P and D pods of one service land, relative to each other.

Rendered by operator/render/placement.py as pod affinity on the zone label and on the network-layer
labels EKS puts on nodes of instance types with EC2 instance topology (docs/install.md "Placement").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.operator.spec.fields import f

SAME_ZONE = ("required", "preferred", "none")
NETWORK_TOPOLOGY = ("preferred", "none")
GANG = ("kueue", "none")


@dataclass
class Placement:
    """Where the engine pods of one service land relative to each other (both roles together)."""

    same_zone: str | None = f(
        "Keep all prefill and decode pods of this service in one zone (topology.kubernetes.io/zone). "
        "required: a pod that cannot join the zone of the pods already placed stays Pending (EFA does not "
        "cross zones); preferred: the scheduler tries, and places elsewhere rather than not at all; none. "
        "Unset: preferred on EFA presets (p5en, p5, trn2, trn1), none otherwise.",
        None,
        enum=list(SAME_ZONE),
    )
    network_topology: str | None = f(
        "Prefer nodes close in the EC2 network (the topology.k8s.aws/network-node-layer-1..3 labels EKS "
        "sets): pods sharing the bottom layer score highest, then the middle, then the top. preferred or "
        "none. Unset: preferred on EFA presets, none otherwise.",
        None,
        enum=list(NETWORK_TOPOLOGY),
    )
    gang: str = f(
        "How the engine pods are admitted. kueue: every prefill and decode pod of this service is one "
        "Kueue pod group in the LocalQueue `queueName`, admitted all or nothing (needs Kueue with its pod "
        "integration). none: the scheduler places pods one by one, so one role may run without the other; "
        "the GangAdmitted condition says which gang admission APIs the cluster serves.",
        "none",
        enum=list(GANG),
    )
    queue_name: str | None = f(
        "Kueue LocalQueue (in the CR's namespace) that admits the pod group; required with gang kueue.",
        None,
        minLength=1,
        maxLength=63,
    )
