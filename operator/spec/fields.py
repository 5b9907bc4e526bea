"""The documented spec field: doc, default and OpenAPI keywords in one place, read by crdgen and parse."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def f(doc: str, default: Any = dataclasses.MISSING, **schema: Any) -> Any:
    """A documented spec field; `schema` holds OpenAPI keywords (enum, minimum, maxItems, ...)."""
    meta = {"doc": doc, "schema": schema}
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


Obj = dict[str, Any]  # free-form Kubernetes object (schema: x-kubernetes-preserve-unknown-fields)
