"""kvferry.connector: push-mode KV transfer for vLLM over NIXL, plus the P/D router.

vLLM loads the connector class from here through
`"kv_connector_module_path": "kvferry.connector"` (see connector/README.md). The class is resolved
lazily so that importing this package (the router image) needs neither vLLM, torch nor NIXL.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"KvferryConnector": "kvferry.connector.connector"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvferry.connector' has no attribute {name!r}")
