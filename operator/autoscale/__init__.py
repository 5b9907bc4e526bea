"""Autoscaling prefill and decode to latency targets (spec.autoscaling; docs/autoscaling.md).

`signals` (engines' histograms -> one window, pure), `planner` (window -> desired replicas with a
reason, pure), `writer` (StatefulSet /scale, or a gauge for HPA/KEDA), `loop` (one evaluation per CR).
"""
