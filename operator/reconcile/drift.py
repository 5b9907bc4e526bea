"""Drift step: does a stored object still hold what we render? Compared as Kubernetes values (pure).

The API server stores values in its own canonical form: a rendered `5120Mi` comes back as `5Gi`,
`1000m` as `1`, `"8"` as `8`; it fills defaults we never render and prunes empty maps and lists.
Comparing text would call every such object drifted, and each watch event on it (a pod turning
ready) would re-apply everything and post a false DriftCorrected: a drift storm.
"""

from __future__ import annotations

from typing import Any

from kvferry.operator.spec.quantity import quantity

# Keys whose values are Kubernetes quantities (resources.requests/limits maps, emptyDir sizeLimit).
# quantity() is bounded (spec/quantity.py): a CR's hostile exponent costs nothing here.
QUANTITY_MAPS = {"requests", "limits"}
QUANTITY_KEYS = {"sizeLimit", "storage"}


def same_scalar(desired: Any, actual: Any, quantities: bool) -> bool:
    if str(desired) == str(actual):  # the API server may store "8" as 8 (int-or-string fields)
        return True
    if quantities:
        a, b = quantity(desired), quantity(actual)
        return a is not None and a == b
    return False


def _prunes_away(value: Any) -> bool:
    """An empty map or list, or a map of only such values: the API server stores nothing for it."""
    if isinstance(value, dict):
        return all(_prunes_away(v) for v in value.values())
    return isinstance(value, list) and not value


def is_subset(desired: Any, actual: Any, key: str = "", parent: str = "") -> bool:
    """Whether every field we render is present with our value (server defaults may add more).

    An empty rendered map or list matches an absent one (the server prunes them); quantities
    compare by value.
    """
    if actual is None and _prunes_away(desired):
        return True
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            is_subset(v, actual.get(k), k, key) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(is_subset(d, a, key, parent) for d, a in zip(desired, actual, strict=True))
        )
    return same_scalar(desired, actual, parent in QUANTITY_MAPS or key in QUANTITY_KEYS)


def drifted(desired: dict[str, Any], actual: dict[str, Any]) -> bool:
    """A managed object differs from the render in fields we own (metadata labels, spec, data, rules)."""
    for key in ("spec", "data", "rules", "roleRef", "subjects"):
        if key in desired and not is_subset(desired[key], actual.get(key), key):
            return True
    return not is_subset(desired["metadata"].get("labels", {}), actual["metadata"].get("labels", {}))


def up_to_date(desired: dict[str, Any], stored: dict[str, Any]) -> bool:
    """Whether applying `desired` over `stored` would change nothing we render: every top-level field,
    labels, annotations and owner references. (`drifted` is the narrower test for watch events.)"""
    meta, have = desired["metadata"], stored.get("metadata") or {}
    for key, value in desired.items():
        if key not in ("apiVersion", "kind", "metadata", "status") and not is_subset(
            value, stored.get(key), key
        ):
            return False
    return all(
        is_subset(meta.get(key, {} if key != "ownerReferences" else []), have.get(key), key)
        for key in ("labels", "annotations", "ownerReferences")
    )
