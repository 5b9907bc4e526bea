"""Status schema step: the shape of a DisaggregatedInference's status, for the CRD (status.py fills it).

Kept apart from spec.py (the user's API) so each stays a readable size; codegen/crdgen.py reads both.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.operator.spec import f


@dataclass
class RoleStatus:
    """Observed state of one role's StatefulSet."""

    desired: int = f("Replicas the operator asked for.", 0)
    replicas: int = f("Pods that exist.", 0)
    ready_replicas: int = f("Pods that are Ready.", 0)
    updated_replicas: int = f("Pods on the current revision.", 0)
    summary: str = f("ready/desired, for `kubectl get`.", "")
    selector: str = f("Label selector of the role's pods (for the scale subresource and HPA).", "")


@dataclass
class RouterStatus:
    replicas: int = f("Router pods.", 0)
    ready_replicas: int = f("Ready router pods.", 0)


@dataclass
class TransferStatus:
    """Connector metrics summed over the pods by the status timer."""

    mode: str = f("Transfer mode in effect.", "")
    backend: str = f("NIXL backend the pods report.", "")
    transfers: int = f("Completed transfers (total).", 0)
    failures: int = f("Failed transfers (total).", 0)
    p50: str = f("Median transfer time, e.g. 41ms.", "")
    p99: str = f("99th-percentile transfer time.", "")
    p50_seconds: float | None = f("Median transfer time in seconds.", None)
    p99_seconds: float | None = f("99th-percentile transfer time in seconds.", None)
    local_tokens: int = f("Prompt tokens decode computed itself.", 0)
    external_tokens: int = f("Prompt tokens decode received as KV.", 0)
    prefix_hit_rate: str = f(
        "Share of prompt tokens both roles found in their prefix caches since the pods started, e.g. 42%.", ""
    )
    prefix_hit_tokens: int = f("Prompt tokens found in the prefix caches (vllm:prefix_cache_hits).", 0)
    prefix_query_tokens: int = f("Prompt tokens looked up there (vllm:prefix_cache_queries).", 0)
    layout_mismatches: int = f("Transfers refused because P's and D's KV layouts cannot be mapped.", 0)
    sample_mismatches: int = f("Receives whose sampled KV was not what prefill sent (the sentinel).", 0)
    held_receives: int = f(
        "Decode receives whose blocks are held for a producer that never answered past the deadline "
        "(a bounded leak: they are never reused while that producer may still write).",
        0,
    )
    last_failure: str = f("Reason label of the most recent failures.", "")
    last_failure_time: str = f("When failures last increased.", "")
    scraped_pods: int = f("Pods whose metrics were read in the last scrape.", 0)
    last_scrape_time: str = f("When a scrape last changed this summary.", "")


@dataclass
class RoleScaling:
    """The autoscale planner's last decision for one role."""

    current: int = f("Replicas the role had when the planner last looked.", 0)
    desired: int = f("Replicas the planner wants.", 0)
    reason: str = f("Why: the signal and target it acted on, and any bound or window that held it.", "")


@dataclass
class AutoscalingStatus:
    """What the autoscale planner sees and decides (spec.autoscaling; written every evaluation)."""

    targets: str = f("The latency targets, e.g. `TTFT p90 1.00s, ITL p90 50ms`.", "")
    latency: str = f("Observed/target over the last window, for `kubectl get`.", "")
    ttft_seconds: float | None = f("Observed TTFT at the spec's percentile; unset: too few requests.", None)
    itl_seconds: float | None = f("Observed inter-token latency at the spec's percentile.", None)
    requests: int = f("First tokens decode produced in the last window.", 0)
    prefill_waiting: int = f("Requests waiting on prefill engines.", 0)
    decode_waiting: int = f("Requests waiting on decode engines.", 0)
    decode_kv_usage: float = f("KV cache usage of the fullest decode engine (0..1).", 0.0)
    prefill: RoleScaling = f("Prefill decision.", RoleScaling())
    decode: RoleScaling = f("Decode decision.", RoleScaling())
    summary: str = f("Replicas now and wanted, e.g. `P 1->2 D 2`.", "")
    output: str = f("scale (written to /scale) or metrics (published for an HPA or KEDA).", "")
    last_decision: str = f("The last decision that changed replicas, with its reason.", "")
    last_decision_time: str = f("When it was made.", "")


@dataclass
class RolePlacement:
    """Where one role's pods landed (operator/status/landed.py)."""

    zones: list[str] = f("Zones of its bound pods (topology.kubernetes.io/zone; unknown without it).", [])
    pods: int = f("Pods bound to a node.", 0)
    network_nodes: list[str] = f(
        "Bottom-layer EC2 network nodes of its bound pods (topology.k8s.aws/network-node-layer-3, copied "
        "from the node by the operator); empty where nodes carry no network topology.",
        [],
    )


@dataclass
class PlacementStatus:
    """Where the engine pods landed, from the pods' zone labels (read by the metrics timer)."""

    prefill: RolePlacement = f("Prefill pods.", RolePlacement())
    decode: RolePlacement = f("Decode pods.", RolePlacement())
    zone: str = f("The zone all engine pods are in; `split` across zones; empty before any lands.", "")


@dataclass
class Condition:
    type: str = f("Ready, Progressing, TransferHealthy or Degraded.")
    status: str = f("True, False or Unknown.", enum=["True", "False", "Unknown"])
    reason: str = f("CamelCase reason.", "")
    message: str = f("Human-readable detail.", "")
    observed_generation: int = f("Generation this condition was computed for.", 0)
    last_transition_time: str = f("When status last flipped.", "")


@dataclass
class Status:
    observed_generation: int = f("Last generation reconciled.", 0)
    revision: str = f("Hash of what prefill and decode must agree on; a pod label on both roles.", "")
    endpoint: str = f("URL clients call (the router Service).", "")
    prefill: RoleStatus = f("Prefill StatefulSet.", RoleStatus())
    decode: RoleStatus = f("Decode StatefulSet.", RoleStatus())
    router: RouterStatus = f("Router Deployment.", RouterStatus())
    transfer: TransferStatus = f("KV transfer summary.", TransferStatus())
    placement: PlacementStatus = f("Where prefill and decode pods landed.", PlacementStatus())
    conditions: list[Condition] = f("Ready, Progressing, TransferHealthy, Degraded.", [])
    autoscaling: AutoscalingStatus | None = f("The autoscale planner's view and last decision.", None)
