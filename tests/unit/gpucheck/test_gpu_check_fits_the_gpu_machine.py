"""The GPU check runs on the accelerator machine as it is: Python 3.12 + torch, no vLLM, no network,
at most 64 MiB carried per run. Its modules import nothing beyond torch, numpy, NIXL, kvferry and the
small wheels docs/verification.md downloads (checked in a clean interpreter with vLLM unimportable),
and the carry (this tree as it travels + those wheels) stays under the limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CARRY_LIMIT = 64 * 2**20  # the device machine's carry limit (its README: "64 MiB in all")
# Sizes in bytes of the wheels carried (cp312, manylinux_2_28_x86_64), from `pip download --no-deps
# --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.12 <wheel>` on 2026-12-04:
# nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl is the 58.8 MB of the issue.
WHEELS = {
    "nixl_cu13": 58_768_877,  # nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
    "nixl": 11_805,  # nixl-1.5.1-py3-none-any.whl: the `nixl` package and nixl_meta_utils
    "msgspec": 236_624,  # msgspec-0.23.0-cp312-...-manylinux_2_28_x86_64.whl (connector wire/config)
    "prometheus_client": 64_494,  # prometheus_client-0.26.0-py3-none-any.whl (connector metrics)
}
# Importable modules each wheel provides.
PROVIDES = {"nixl_cu13": "nixl_cu13", "nixl_meta_utils": "nixl", "nixl": "nixl", "msgspec": "msgspec",
            "prometheus_client": "prometheus_client"}  # fmt: skip
# What a bare torch 2.11 environment already has (torch's own requirements, and torch itself).
IN_TORCH_ENV = {"torch", "numpy", "typing_extensions", "filelock", "sympy", "networkx", "jinja2", "fsspec",
                "mpmath", "markupsafe", "setuptools", "nvidia", "triton"}  # fmt: skip
MODULES = [
    "kvferry.tools.gpucheck.run", "kvferry.tools.gpucheck.ranks", "kvferry.tools.gpucheck.devkv",
    "kvferry.tools.gpucheck.pages", "kvferry.tools.gpucheck.raw", "kvferry.connector.endpoint",
    "kvferry.connector.staging", "kvferry.connector.config", "kvferry.connector.kvcache", "nixl._api",
    "kvferry.cli",
]  # fmt: skip
PROBE = """
import json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is blocked")
sys.meta_path.insert(0, Block())
import torch  # the GPU check's children do: a CUDA machine's torch imports its own
before = set(sys.modules)
for m in MODULES:
    __import__(m)
new = {m.split(".")[0] for m in set(sys.modules) - before}
print(json.dumps(sorted(n for n in new if n not in sys.stdlib_module_names and not n.startswith("_"))))
"""


def imported_third_party() -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"MODULES = {MODULES!r}\n{PROBE}"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_gpu_check_imports_no_vllm_and_only_the_carried_wheels():
    found = imported_third_party() - {"kvferry"}
    missing = found - set(PROVIDES) - IN_TORCH_ENV
    assert not missing, f"the GPU check imports {sorted(missing)}, neither in a torch env nor carried"
    assert "vllm" not in found
    assert {PROVIDES[m] for m in found if m in PROVIDES} <= set(WHEELS)


def tree_bytes() -> int:
    """What a run carries of this tree: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
        capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    paths = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def test_tree_and_wheels_fit_the_carry():
    total = tree_bytes() + sum(WHEELS.values())
    room = CARRY_LIMIT - total
    assert room > 0, f"carry {total / 2**20:.1f} MiB over {CARRY_LIMIT / 2**20:.0f} MiB"
    # the tree may grow: say so while there is still room for it to be trimmed
    assert room > 512 * 2**10, f"only {room / 2**10:.0f} KiB left in the carry"
