"""kvferry.operator: DisaggregatedInference reconciled into prefill/decode StatefulSets and a router."""
