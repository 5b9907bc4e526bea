"""Fixtures shared across test folders, registered as plugins (pytest reads `pytest_plugins` only in
this top-level conftest): test modules request them by name and import only plain helpers."""

pytest_plugins = [
    "tests.cluster.plane_fixtures",
    "tests.cluster.operator_fixtures",
    "tests.cluster.engine_metrics",
    "tests.cluster.status_log",
    "tests.e2e.shared_stack",
]
