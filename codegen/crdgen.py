"""CRD generation step (pure): spec.py's dataclasses and rules -> the CRDs and the API reference text.

`kvferry generate` (codegen/generate.py) writes them to crds/*.yaml and docs/api-reference.md, together
with the chart and manifests made from them; `kvferry generate --check` fails when one is stale.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

import yaml
from kvferry.operator import spec as s
from kvferry.operator.status import schema as st

# The first line of every generated file names the command that writes it.
GENERATED_BY = "kvferry generate"

PRINTER_COLUMNS = [
    {"name": "Mode", "type": "string", "jsonPath": ".spec.kvTransfer.mode"},
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.prefill.summary",
        "description": "ready/desired",
    },
    {
        "name": "Decode",
        "type": "string",
        "jsonPath": ".status.decode.summary",
        "description": "ready/desired",
    },
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Transfers", "type": "integer", "jsonPath": ".status.transfer.transfers"},
    {"name": "Failed", "type": "integer", "jsonPath": ".status.transfer.failures"},
    {"name": "Xfer-P50", "type": "string", "jsonPath": ".status.transfer.p50"},
    {
        "name": "Prefix-Hit",
        "type": "string",
        "jsonPath": ".status.transfer.prefixHitRate",
        "description": "share of prompt tokens found in the engines' prefix caches",
    },
    {
        "name": "Latency",
        "type": "string",
        "jsonPath": ".status.autoscaling.latency",
        "description": "autoscaling: observed/target TTFT and ITL",
        "priority": 1,
    },
    {
        "name": "Autoscale",
        "type": "string",
        "jsonPath": ".status.autoscaling.summary",
        "description": "replicas now -> wanted by the planner",
        "priority": 1,
    },
    {"name": "Scale-Reason", "type": "string", "jsonPath": ".status.autoscaling.lastDecision", "priority": 1},
    {
        "name": "Zone",
        "type": "string",
        "jsonPath": ".status.placement.zone",
        "description": "zone of every engine pod, or split",
        "priority": 1,
    },
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
_FREE_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def type_schema(tp: Any, extra: dict[str, Any], with_defaults: bool) -> dict[str, Any]:
    """OpenAPI v3 schema of one Python type (the subset spec.py uses)."""
    tp, _ = s.unwrap_optional(tp)
    if dataclasses.is_dataclass(tp):
        return object_schema(tp, with_defaults)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        items = type_schema(item_tp, extra.get("items", {}), with_defaults)
        return {"type": "array", "items": items, **{k: v for k, v in extra.items() if k != "items"}}
    if origin is dict:
        _, val_tp = typing.get_args(tp)
        if val_tp is str:
            return {"type": "object", "additionalProperties": {"type": "string"}}
        # A free object may declare some fields (CEL reads only declared ones); the rest is kept.
        return {**_FREE_OBJECT, **extra}
    return {"type": _SCALARS[tp], **extra}


def object_schema(cls: type, with_defaults: bool = True) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for fl in dataclasses.fields(cls):
        key = s.camel(fl.name)
        prop = {
            "description": fl.metadata["doc"],
            **type_schema(hints[fl.name], fl.metadata["schema"], with_defaults),
        }
        if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
            required.append(key)
        elif with_defaults:
            default = fl.default if fl.default_factory is dataclasses.MISSING else fl.default_factory()
            if dataclasses.is_dataclass(default):
                # `{}` makes the API server apply the nested defaults, so CEL always sees them.
                prop["default"] = {}
            elif default is not None:
                prop["default"] = default
        props[key] = prop
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        schema = {"description": " ".join(inspect.cleandoc(cls.__doc__).split()), **schema}
    if required:
        schema["required"] = required
    return schema


def sections(root: type) -> list[type]:
    """`root` and every dataclass reachable from its fields, in field order, each once (the doc tables)."""
    found: list[type] = []

    def visit(tp: Any) -> None:
        tp, _ = s.unwrap_optional(tp)
        for arg in typing.get_args(tp):
            visit(arg)
        if dataclasses.is_dataclass(tp) and isinstance(tp, type) and tp not in found:
            found.append(tp)
            for hint in typing.get_type_hints(tp).values():
                visit(hint)

    visit(root)
    return found


def crd() -> dict[str, Any]:
    spec_schema = object_schema(s.Spec)
    spec_schema["x-kubernetes-validations"] = [
        {"rule": r.cel, "message": r.message, "fieldPath": r.field_path, "reason": "FieldValueInvalid"}
        for r in s.RULES
    ]
    status_schema = object_schema(st.Status, with_defaults=False)
    conditions = status_schema["properties"]["conditions"]
    conditions.update({"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    root = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        "x-kubernetes-validations": [{"rule": s.NAME_RULE[0], "message": s.NAME_RULE[1]}],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{s.PLURAL}.{s.GROUP}"},
        "spec": {
            "group": s.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": s.KIND,
                "listKind": f"{s.KIND}List",
                "plural": s.PLURAL,
                "singular": s.SINGULAR,
                "shortNames": s.SHORT_NAMES,
                "categories": ["kvferry"],
            },
            "versions": [
                {
                    "name": s.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        # The scale subresource drives decode (the role users scale most); prefill scales
                        # through spec.prefill.replicas.
                        "scale": {
                            "specReplicasPath": ".spec.decode.replicas",
                            "statusReplicasPath": ".status.decode.replicas",
                            "labelSelectorPath": ".status.decode.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def peering_crds() -> list[dict[str, Any]]:
    """kopf's peering resources (kopf.dev), needed for leader election between operator replicas."""
    out = []
    for kind, scope in (("ClusterKopfPeering", "Cluster"), ("KopfPeering", "Namespaced")):
        plural = kind.lower() + "s"
        out.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.kopf.dev"},
                "spec": {
                    "group": "kopf.dev",
                    "scope": scope,
                    "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {
                                        "status": {
                                            "type": "object",
                                            "x-kubernetes-preserve-unknown-fields": True,
                                        }
                                    },
                                }
                            },
                        }
                    ],
                },
            }
        )
    return out


def _doc_type(tp: Any) -> str:
    tp, optional = s.unwrap_optional(tp)
    if dataclasses.is_dataclass(tp):
        name = f"[{tp.__name__}](#{tp.__name__.lower()})"
    elif typing.get_origin(tp) is list:
        name = f"list of {_doc_type(typing.get_args(tp)[0])}"
    elif typing.get_origin(tp) is dict:
        name = "map string→string" if typing.get_args(tp)[1] is str else "object"
    else:
        name = _SCALARS[tp]
    return name + (" (optional)" if optional else "")


def _doc_table(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = [
        f"### {cls.__name__}",
        "",
        " ".join(inspect.cleandoc(cls.__doc__ or "").split()),
        "",
        "| field | type | default | description |",
        "|---|---|---|---|",
    ]
    for fl in dataclasses.fields(cls):
        schema = fl.metadata["schema"]
        if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
            default = "**required**"
        elif fl.default_factory is not dataclasses.MISSING:
            value = fl.default_factory()
            default = "" if dataclasses.is_dataclass(value) else f"`{value}`"
        else:
            default = "" if fl.default is None else f"`{fl.default}`"
        bounds = [f"{k} {v}" for k, v in schema.items() if k in ("minimum", "maximum", "maxItems")]
        if "enum" in schema:
            bounds.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
        doc = fl.metadata["doc"] + (f" ({'; '.join(bounds)})" if bounds else "")
        lines.append(f"| `{s.camel(fl.name)}` | {_doc_type(hints[fl.name])} | {default} | {doc} |")
    return [*lines, ""]


def api_reference() -> str:
    lines = [
        "# API reference: DisaggregatedInference",
        "",
        f"<!-- Generated by `{GENERATED_BY}` from operator/spec/. Do not edit by hand. -->",
        "",
        f"`apiVersion: {s.GROUP}/{s.VERSION}`, `kind: {s.KIND}` (short name `{s.SHORT_NAMES[0]}`). "
        "Status and scale subresources; `kubectl scale` sets `spec.decode.replicas`.",
        "",
        "## Spec",
        "",
    ]
    for cls in sections(s.Spec):
        lines += _doc_table(cls)
    lines += [
        "## Validation rules (CEL, checked by the API server and by `kvferry render`)",
        "",
        "| field | rule | message |",
        "|---|---|---|",
    ]
    for r in s.RULES:
        lines.append(f"| `spec{r.field_path}` | `{r.cel.replace('|', '&#124;')}` | {r.message} |")
    lines += [f"| `metadata.name` | `{s.NAME_RULE[0]}` | {s.NAME_RULE[1]} |", "", "## Status", ""]
    for cls in sections(st.Status):
        lines += _doc_table(cls)
    lines += ["## Printer columns", "", "| column | JSONPath |", "|---|---|"]
    lines += [f"| {c['name']} | `{c['jsonPath']}` |" for c in PRINTER_COLUMNS]
    return "\n".join(lines) + "\n"


def dump(docs: list[dict[str, Any]], source: str = "operator/spec/") -> str:
    """YAML documents under a header saying where they come from."""
    header = f"# Generated by `{GENERATED_BY}` from {source}. Do not edit by hand.\n"
    return header + yaml.safe_dump_all(docs, sort_keys=False, width=120)
