"""Label keys on what the operator renders, read by the router and the connector (contracts.md §3).

The operator writes them (operator/spec/names.py re-exports them beside its own keys); the router pairs
prefill and decode by REVISION; the connector rejects peers whose revision (the same value, passed in
kv_connector_extra_config) differs.
"""

from __future__ import annotations

# Every rendered object and pod: the owning DisaggregatedInference's name.
NAME = "kvferry.io/name"
# Every rendered object and pod: prefill | decode | router (and the other parts' own names).
ROLE = "kvferry.io/role"
# Both roles' pod templates and StatefulSets: hash of everything P and D must agree on. The router
# pairs only pods with equal values (its discovery config `revision_label` defaults to this).
REVISION = "kvferry.io/revision"

# Where a node sits, broadest first: the standard zone label, then the network node above it at each
# layer that EKS sets on instance types with EC2 instance topology (1 = top, 3 = bottom). The operator
# renders pod affinity on them; the router prefers P/D pairs that share the most leading levels.
ZONE = "topology.kubernetes.io/zone"
NETWORK_LAYERS = tuple(f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3))
