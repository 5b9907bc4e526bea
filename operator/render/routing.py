"""Router-config step: the CR's router.routing section as the router's `routing:` (router/config.py)."""

from __future__ import annotations

from typing import Any

from kvferry.operator.render import presets
from kvferry.operator.spec import Spec


def routing_config(spec: Spec) -> dict[str, Any]:
    """Prefix blocks are the engines' own KV blocks (the effective block size); prefix awareness needs
    least-loaded selection (round-robin ignores caches, as the field's doc says)."""
    r = spec.router.routing
    d = r.disaggregation
    return {
        "prefix_aware": r.prefix_aware and spec.router.policy == "least-loaded",
        "block_tokens": presets.block_size(spec),
        "chars_per_token": float(r.chars_per_token),
        "load_bound": r.load_bound,
        "index_blocks_per_engine": r.index_blocks_per_engine,
        "disaggregation": {
            "rule": d.rule,
            "min_prefill_tokens": d.min_prefill_tokens,
            "decode_hit_fraction": d.decode_hit_percent / 100,
        },
    }
