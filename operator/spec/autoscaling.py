"""The `spec.autoscaling` section: latency targets the operator's planner scales prefill and decode to.

Prefill saturates on prompt tokens per second (time to first token), decode on concurrent sequences
and KV capacity (inter-token latency), so each role has its own target and bounds. The planner
(operator/autoscale/) reads the engines' own latency histograms and writes each role's StatefulSet
`/scale`; docs/autoscaling.md is the tuning guide.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.operator.spec.fields import f

PERCENTILES = ("p50", "p90")
OUTPUTS = ("scale", "metrics")


@dataclass
class ReplicaBounds:
    """How far the planner may move one role."""

    min_replicas: int = f("Fewest pods the planner leaves this role.", 1, minimum=1, maximum=1000)
    max_replicas: int = f("Most pods the planner gives this role.", 4, minimum=1, maximum=1000)


@dataclass
class RatioBounds:
    """Bounds on prefill pods per decode pod (prefill replicas / decode replicas), applied after the
    per-role targets; unset bounds are not enforced."""

    # Bounded both ways: the planner multiplies and divides replicas by them (math.ceil of an inf fails).
    min: float | None = f(
        "Smallest prefill:decode ratio, e.g. 0.25 (one P per four D).", None, minimum=0.01, maximum=1000
    )
    max: float | None = f(
        "Largest prefill:decode ratio, e.g. 2 (two P per D).", None, minimum=0.01, maximum=1000
    )


@dataclass
class Autoscaling:
    """Scale prefill to a time-to-first-token target and decode to an inter-token-latency target.

    Needs `replicasOwner: autoscaler` on both roles: the planner then owns their replicas (spec
    `replicas` is only the starting size), so Git, the operator's apply and the planner never fight.
    """

    ttft_seconds: float = f(
        "Time-to-first-token target (decode engines' vllm:time_to_first_token_seconds: arrival at decode "
        "to first token, KV wait included). Prefill scales out while it is above.",
        minimum=0.001,
        maximum=3600,
    )
    itl_seconds: float = f(
        "Inter-token-latency target (decode engines' vllm:inter_token_latency_seconds). Decode scales "
        "out while it is above.",
        minimum=0.0001,
        maximum=60,
    )
    percentile: str = f(
        "Which latency percentile is held to the targets, over each evaluation window.",
        "p90",
        enum=list(PERCENTILES),
    )
    prefill: ReplicaBounds = f("Prefill replica bounds.", ReplicaBounds())
    decode: ReplicaBounds = f("Decode replica bounds.", ReplicaBounds())
    ratio: RatioBounds = f("Optional bounds on the prefill:decode ratio.", RatioBounds())
    scale_down_stabilization_seconds: int = f(
        "A role shrinks (one pod per evaluation) only while every evaluation over this window "
        "recommended shrinking it, so a short lull does not remove a pod the next burst needs.",
        300,
        minimum=0,
        maximum=3600,
    )
    scale_down_below: float = f(
        "A role may shrink only while its latency is below this fraction of its target (headroom: the "
        "remaining pods take the removed one's load).",
        0.5,
        minimum=0.05,
        maximum=0.95,
    )
    output: str = f(
        "scale: the operator writes each role's StatefulSet /scale. metrics: it only publishes the "
        "desired replicas (status and kvferry_autoscale_desired_replicas on its metrics port) for an "
        "HPA or KEDA to act on.",
        "scale",
        enum=list(OUTPUTS),
    )
