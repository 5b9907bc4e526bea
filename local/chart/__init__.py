"""Install artifacts from one source: the operator's CRD and RBAC into the chart, the chart into manifests/.

- `templates.py` (pure): CRD and RBAC rule templates for charts/kvferry from the operator's own
  outputs (crds/disaggregatedinferences.yaml, the rule list in kvferry.operator.rbac).
- `helm.py`: runs the real `helm` binary (template, lint) with bounded time.
- `__main__.py`: `python -m kvferry.local.chart sync|check` writes or verifies every generated file.
"""
