"""Upstream patch step: opt-in changes to upstream vLLM NIXL behaviour, for comparison runs only.

vLLM's NIXL connectors create their agent with `nixl_agent_config(num_threads=4, ...)`, which keeps
NIXL's UCX progress thread on. On a CPU-only host that thread busy-spins a core per worker
(`ucp_worker_arm`), halving P/D throughput on two cores. With
`KVFERRY_NIXL_NO_PROGRESS_THREAD=1` this module makes those configs use `enable_prog_thread=False`;
vLLM still progresses transfers by polling. This is a patch of upstream behaviour, applied only to
the upstream-connector baselines; the kvferry connector owns its agent config and does not need it.

Loaded in every vLLM process through vLLM's documented `vllm.general_plugins` entry point (see
pyproject.toml), so no sitecustomize or import hook is involved. Without the env var it does nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV_NO_PROGRESS_THREAD = "KVFERRY_NIXL_NO_PROGRESS_THREAD"


def _agent_config_without_progress_thread(*args: Any, **kwargs: Any) -> Any:
    from vllm.distributed import nixl_utils

    # Resolve the real class lazily: importing NIXL in every vLLM process costs ~220 MiB each.
    real = nixl_utils._load_nixl_attr("nixl_agent_config")
    if real is None:
        return None
    kwargs["enable_prog_thread"] = False
    return real(*args, **kwargs)


def register() -> None:
    """vLLM general-plugin hook; runs once per vLLM process."""
    if os.environ.get(ENV_NO_PROGRESS_THREAD) != "1":
        return
    from vllm.distributed import nixl_utils

    # `base_worker` does `from nixl_utils import nixl_agent_config`: setting the module attribute
    # before that import wins over the module's lazy __getattr__; patch an earlier import too.
    nixl_utils.nixl_agent_config = _agent_config_without_progress_thread
    base_worker = sys.modules.get("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    if base_worker is not None:
        base_worker.nixl_agent_config = _agent_config_without_progress_thread
