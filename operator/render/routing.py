"""Router-config step: the CR's router.routing section as the router's `routing:` (router/config.py)."""

from __future__ import annotations

from typing import Any

from kvferry.contracts import pods
from kvferry.operator.render import presets
from kvferry.operator.spec import Spec


def kv_events(spec: Spec) -> bool:
    """Whether the engines publish KV-cache events for the router: only when it routes by prefix and
    the engines keep a prefix cache to report on."""
    r = spec.router.routing
    return bool(r.kv_events and r.prefix_aware and spec.router.policy == "least-loaded") and bool(
        spec.vllm.enable_prefix_caching
    )


def kv_events_config() -> dict[str, Any]:
    """vLLM's --kv-events-config: bound on every address of the pod; the router connects to the pod IP."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pods.KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{pods.KV_EVENTS_REPLAY_PORT}",
        "topic": "kv-events",
    }


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
