#!/usr/bin/env python3
"""GPU check: kvferry P/D on one CUDA device against a single vLLM, in one command, no network.

    python scripts/gpu_check.py [--quick] [--out results.json] [--backend UCX] [--enforce-eager]
                                [--kv-buffer-devices cuda,cpu]

Prints `SKIP: <reason>` and exits 0 on a machine without a usable CUDA device. What it runs, what
it reports and its exit status: scripts/gpucheck/__init__.py (also the --help text); the code is
the gpucheck package next to this file, found from any working directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from gpucheck.cli import main  # noqa: E402 - needs HERE on sys.path

if __name__ == "__main__":
    sys.exit(main())
