"""The tiny model: built locally by `kvferry model build` (kvferry.local.tinymodel) in the shape this
check wants, and the shape read back from its config.json.

The build runs as a child process, as vLLM does: tools never import the dev-only `local` package
(the layers contract), and the command line is tinymodel's stable interface."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TINYMODEL_MODULE = "kvferry.local.tinymodel"
# The model shape this check wants: GQA with vLLM's CUDA head size, in the dtype of the servers.
SHAPE = {"heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bfloat16"}
BUILD_TIMEOUT_S = 600.0


class ModelError(RuntimeError):
    pass


def build_command(arch: str, python: str = sys.executable) -> list[str]:
    """`kvferry model build` for `arch` in SHAPE, into the shared cache (built once per recipe)."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in SHAPE.items()]
    return [python, "-m", TINYMODEL_MODULE, "build", f"--arch={arch}", *flags]


def build_model(arch: str) -> tuple[Path, str]:
    """The tiny model (built locally, cached) and a note on its shape options."""
    cmd = build_command(arch)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise ModelError(f"{' '.join(cmd[1:])} exited {proc.returncode}: {proc.stderr[-1500:]}")
    return Path(lines[-1]), f"shape options {sorted(SHAPE)} via kvferry model build"


def model_shape(model: Path) -> dict[str, Any]:
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    out = {k: config.get(k) for k in keys}
    out["dtype"] = config.get("dtype") or config.get("torch_dtype")
    return out
