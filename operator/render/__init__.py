"""Render: a DisaggregatedInference spec -> the Kubernetes objects it wants (pure: no kopf, no API calls)."""
