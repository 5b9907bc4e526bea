"""A DisaggregatedInference as the operator takes it: typed metadata and spec, parsed once at the edge.

The handler (or `kvferry render`, `kvferry doctor`) that receives a CR body calls `Inference.of(body)`
and hands the result down: render, status and autoscale read `cr.meta` and `cr.spec`, never the body's
dicts. A spec the API server let through but `parse_spec` rejects is kept as its `SpecError`: the
reconcile publishes it as InvalidSpec, the timers skip the CR (`valid`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvferry.operator.spec.parse import SpecError, parse_spec
from kvferry.operator.spec.types import Spec


@dataclass(frozen=True)
class Meta:
    """The metadata the operator reads of a CR."""

    name: str
    namespace: str
    uid: str = ""  # empty in an offline render: no owner references then
    generation: int = 0
    resource_version: str = ""
    deleting: bool = False  # metadata.deletionTimestamp is set

    @classmethod
    def of(cls, meta: Mapping[str, Any] | None) -> Meta:
        meta = meta or {}
        return cls(
            name=str(meta.get("name") or ""),
            namespace=str(meta.get("namespace") or "default"),
            uid=str(meta.get("uid") or ""),
            generation=int(meta.get("generation") or 0),
            resource_version=str(meta.get("resourceVersion") or ""),
            deleting=bool(meta.get("deletionTimestamp")),
        )


@dataclass(frozen=True)
class Inference:
    """One CR: typed metadata, the spec parsed (or why not), its status, and the body as received
    (the status writer builds on that copy's resourceVersion and status)."""

    meta: Meta
    parsed: Spec | SpecError
    status: dict[str, Any]
    body: dict[str, Any]

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Inference:
        """Parse a CR body (validated as the CRD's schema and CEL rules do, name included)."""
        meta = Meta.of(body.get("metadata"))
        try:
            parsed: Spec | SpecError = parse_spec(body.get("spec"), meta.name)
        except SpecError as exc:
            parsed = exc
        return cls(meta=meta, parsed=parsed, status=dict(body.get("status") or {}), body=dict(body))

    @property
    def valid(self) -> bool:
        return isinstance(self.parsed, Spec)

    @property
    def spec(self) -> Spec:
        """The typed spec; raises SpecError (what parsing found) for an invalid one."""
        if isinstance(self.parsed, SpecError):
            raise SpecError(self.parsed.errors)
        return self.parsed

    @property
    def revision(self) -> str:
        """status.revision: set once a reconcile applied every object at that revision."""
        return str(self.status.get("revision") or "")
