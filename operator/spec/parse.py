"""Offline validation: the CRD's schema and rules applied in Python, errors naming the field."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from kvferry.operator.spec.constants import MAX_NAME_LEN
from kvferry.operator.spec.rules import NAME_RULE, RULES
from kvferry.operator.spec.types import Spec

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class SpecError(ValueError):
    """A spec that the API server would reject; `errors` lists `path: problem` strings."""

    def __init__(self, errors: list[str]):
        super().__init__("invalid DisaggregatedInference:\n  " + "\n  ".join(errors))
        self.errors = errors


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for `X | None`."""
    args = typing.get_args(tp)
    if (typing.get_origin(tp) in (typing.Union, types.UnionType)) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


_SCALARS: dict[type, type | tuple[type, ...]] = {str: str, int: int, float: (int, float), bool: bool}


def _check_scalar(value: Any, tp: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    expected = _SCALARS[tp]
    if not isinstance(value, expected) or (tp is not bool and isinstance(value, bool)):
        errors.append(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: unsupported value {value!r}, expected one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: must be >= {schema['minimum']} (got {value})")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: must be <= {schema['maximum']} (got {value})")
    if "minLength" in schema and isinstance(value, str) and len(value) < schema["minLength"]:
        errors.append(f"{path}: must not be empty")
    if "maxLength" in schema and isinstance(value, str) and len(value) > schema["maxLength"]:
        errors.append(f"{path}: longer than {schema['maxLength']} characters")
    elif "pattern" in schema and isinstance(value, str) and re.search(schema["pattern"], value) is None:
        errors.append(f"{path}: {value!r} does not match the pattern {schema['pattern']}")


def _convert(value: Any, tp: Any, schema: dict[str, Any], path: str, errors: list[str]) -> Any:
    tp, _ = unwrap_optional(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, path, errors)
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return []
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        (item_tp,) = typing.get_args(tp)
        return [
            _convert(v, item_tp, schema.get("items", {}), f"{path}[{i}]", errors) for i, v in enumerate(value)
        ]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return {}
        _, val_tp = typing.get_args(tp)
        if val_tp is str:
            for key, val in value.items():
                _check_scalar(val, str, {}, f"{path}.{key}", errors)
        return dict(value)
    _check_scalar(value, tp, schema, path, errors)
    return value


T = TypeVar("T", bound="DataclassInstance")


def parse_dataclass(cls: type[T], data: Any, path: str, errors: list[str]) -> T | None:
    """Build `cls` from camelCase `data`, collecting errors instead of raising at the first."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(f"{path}: expected a mapping, got {type(data).__name__}")
        data = {}
    hints = typing.get_type_hints(cls)
    known = {camel(fl.name): fl for fl in dataclasses.fields(cls)}
    errors.extend(f"{path}.{key}: unknown field" for key in data if key not in known)
    kwargs: dict[str, Any] = {}
    for key, fl in known.items():
        if key not in data or data[key] is None:
            if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
                errors.append(f"{path}.{key}: required")
            continue
        kwargs[fl.name] = _convert(data[key], hints[fl.name], fl.metadata["schema"], f"{path}.{key}", errors)
    try:
        return cls(**kwargs)
    except TypeError:  # a required field was missing; already reported
        return None


def parse_spec(spec: Any, name: str | None = None) -> Spec:
    """Validate a CR's spec (and name) the way the CRD schema and CEL rules do; raise SpecError."""
    errors: list[str] = []
    parsed = parse_dataclass(Spec, spec, "spec", errors)
    if name is not None and len(name) > MAX_NAME_LEN:
        errors.append(NAME_RULE[1])
    if parsed is not None and not errors:
        errors += [f"spec{rule.field_path}: {rule.message}" for rule in RULES if not rule.check(parsed)]
    if errors or parsed is None:  # None only after a reported error
        raise SpecError(errors)
    return parsed
