"""The spec's routing section: how the router picks engines by the prefixes they hold, and when a
request goes to decode alone instead of prefill and decode (router/scoring.py has the rule).

Rendered into the router's config (`routing:` in router.yaml, docs/router.md) by operator/render.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.operator.spec.fields import f

RULES = ("always", "selective")


@dataclass
class Disaggregation:
    """Whether a request pays for prefill and decode, decided per request by the router."""

    rule: str = f(
        "always: every request goes through prefill and decode. selective: decode alone serves (and "
        "prefills locally) a request whose tokens decode lacks are fewer than minPrefillTokens, or whose "
        "prompt decode already holds at least decodeHitPercent of, when decode holds at least as much of it "
        "as the chosen prefill (decode alone then computes no more than prefill would); the rest go through "
        "prefill and decode.",
        "always",
        enum=list(RULES),
    )
    min_prefill_tokens: int = f(
        "selective: prompt tokens decode lacks (prompt minus the prefix it holds) below which a prefill leg "
        "does not pay. Text prompts are measured in estimated tokens (charsPerToken).",
        256,
        minimum=0,
        maximum=1_000_000,
    )
    decode_hit_percent: int = f(
        "selective: share of the prompt decode already holds at or above which it serves alone.",
        80,
        minimum=1,
        maximum=100,
    )


@dataclass
class Routing:
    """Prefix-aware engine choice and selective disaggregation (docs/router.md "Prefix-aware routing")."""

    prefix_aware: bool = f(
        "Prefer the engines holding the longest prefix of each prompt (the router remembers what it sent "
        "where), within loadBound of the least-loaded engine. Applies with router.policy least-loaded; "
        "round-robin ignores it (it picks in turn by design).",
        True,
    )
    load_bound: int = f(
        "How many requests busier than the least-loaded engine a prefix holder may be and still win: a hot "
        "prefix spreads to other pods instead of piling on one.",
        2,
        minimum=0,
        maximum=10_000,
    )
    chars_per_token: float = f(
        "Characters per token for text prompts (the router does not tokenize): sizes text blocks and "
        "estimates prompt tokens for the disaggregation rule.",
        4.0,
        minimum=0.5,
        maximum=64,
    )
    kv_events: bool = f(
        "With prefixAware: engines publish vLLM's KV-cache events (--kv-events-config, ZMQ on ports 5557 "
        "and 5558) and the router follows them, so it knows the blocks each engine cached (answers it "
        "generated included) and evicted; without them it knows only what it sent where.",
        True,
    )
    index_blocks_per_engine: int = f(
        "Prefix blocks the router remembers per engine (least recently used forgotten first).",
        65536,
        minimum=1,
        maximum=10_000_000,
    )
    disaggregation: Disaggregation = f("When a request goes to decode alone.", Disaggregation())
