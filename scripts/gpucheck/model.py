"""The tiny model: built locally by kvferry.local.tinymodel in the shape this check wants, whatever
options that tinymodel offers, and the shape read back from its config.json."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# The model shape this check wants, by option; tinymodel names may differ (see shape_overrides).
SHAPE = {"heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16"}
SHAPE_ALIASES = {
    "heads": ("heads", "num_heads", "num_attention_heads", "n_heads"),
    "kv_heads": ("kv_heads", "num_kv_heads", "num_key_value_heads", "n_kv_heads"),
    "head_dim": ("head_dim", "head_size"),
    "dtype": ("dtype", "torch_dtype"),
}
HF_NAMES = {"heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim"}


def shape_overrides(
    ensure_params: Iterable[str], shape_params: Iterable[str] | None = None, var_keyword: bool = False
) -> tuple[str, dict[str, Any], list[str]]:
    """How to ask tinymodel.ensure for SHAPE: (how, kwargs, options it cannot take).

    how is "shape" (ensure takes `shape=Shape(...)`: kwargs are Shape's), "kwargs" (ensure takes the
    options itself), or "none" (only arch: the default shape is built)."""
    ensure_params = list(ensure_params)
    via_shape = "shape" in ensure_params and shape_params is not None
    target = list(shape_params or ()) if via_shape else ensure_params
    kwargs, missing = {}, []
    for option, value in SHAPE.items():
        name = next((a for a in SHAPE_ALIASES[option] if a in target), None)
        if name is None:
            missing.append(option)
        else:
            kwargs[name] = value
    if via_shape and kwargs:
        return "shape", kwargs, missing
    if not kwargs and var_keyword:  # ensure(arch, **overrides): give HF config names
        return "kwargs", {HF_NAMES.get(k, k): v for k, v in SHAPE.items()}, []
    return ("kwargs" if kwargs else "none"), kwargs, missing


def build_model(arch: str) -> tuple[Path, str]:
    """The tiny model (built locally, cached) and a note on which shape options were applied."""
    from kvferry.local import tinymodel

    ensure = tinymodel.ensure
    params = inspect.signature(ensure).parameters
    shape_cls = getattr(tinymodel, "Shape", None)
    shape_params = list(inspect.signature(shape_cls).parameters) if shape_cls is not None else None
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    how, kwargs, missing = shape_overrides(params, shape_params, var_kw)
    if how == "shape":
        assert shape_cls is not None
        path = ensure(arch, shape=shape_cls(**kwargs))
    else:
        path = ensure(arch, **kwargs)
    note = (
        f"shape options {sorted(kwargs)} via {how}" if kwargs else "tinymodel takes only arch: default shape"
    )
    if missing:
        note += f"; not available in tinymodel: {missing}"
    return path, note


def model_shape(model: Path) -> dict[str, Any]:
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    out = {k: config.get(k) for k in keys}
    out["dtype"] = config.get("dtype") or config.get("torch_dtype")
    return out
