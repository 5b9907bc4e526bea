"""Build-time code generation (`kvferry generate`): CRDs and the API reference from operator/spec/, the
operator's RBAC rules, the chart's CRD/RBAC templates and manifests/install.yaml.

Runs on a developer's machine or in CI, never in a pod: no image keeps this package (images/prune.py
keeps only what each image names), and nothing in operator/, router/ or connector/ imports it.
"""
