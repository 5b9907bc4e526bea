"""Scoring step: which engine to pick for reuse within a load bound, and whether P/D pays (pure).

Reuse against load: the engine holding the longest prefix of the prompt wins only while its load is
within `load_bound` requests of the least-loaded candidate. A hot prefix therefore spreads: once its
holder is `load_bound` requests busier than another engine, the next request goes to the other one,
which then holds the prefix too. With no prefix held anywhere the choice is the load-only one.

Selective disaggregation: a prefill leg costs a second engine, a transfer and decode's wait; it pays
only when decode would otherwise compute many tokens. Decode alone serves a request whose tokens it
lacks (prompt minus the prefix it holds) are fewer than `min_prefill_tokens`, or whose prompt it
already holds at least `decode_hit_fraction` of, as long as it holds at least as much as the chosen
prefill: decode alone then computes no more tokens than prefill would (P/D computes the prompt minus
prefill's hit and pushes the prompt minus decode's; decode alone computes the prompt minus decode's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvferry.router.config import Endpoint

Path = Literal["pd", "decode_only"]
# Why a request took its path (kvferry_router_served_total's reason label).
ALWAYS, PREFILL_PAYS, PREFILL_HOLDS_MORE, SHORT_PROMPT, DECODE_HOLDS_PREFIX = (
    "always", "prefill_pays", "prefill_holds_more", "short_prompt", "decode_holds_prefix"
)  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """One engine as scoring sees it: its load, its load-only rank (ties), the prefix blocks it holds."""

    endpoint: Endpoint
    load: float  # legs the router has in flight on it plus its own waiting queue
    rank: tuple[Any, ...]  # the load-only order, least first
    hit_blocks: int = 0
    closeness: int = 0  # topology levels shared with its peer (router/topology.py)


def pick(candidates: Sequence[Candidate], load_bound: float) -> Candidate:
    """Among the candidates within `load_bound` of the least load: the closest to its peer (same zone,
    then same network spine: a cross-zone pair cannot transfer over EFA), then the one holding the most
    prefix blocks; ties (no topology, no prefix) go by the load-only rank."""
    if not candidates:
        raise ValueError("pick needs at least one candidate")
    least = min(c.load for c in candidates)
    eligible = [c for c in candidates if c.load <= least + load_bound]
    return min(eligible, key=lambda c: (-c.closeness, -c.hit_blocks, c.rank))


@dataclass(frozen=True)
class Decision:
    path: Path
    reason: str


def decide(
    rule: str, min_prefill_tokens: int, decode_hit_fraction: float, prompt_tokens: int,
    decode_hit_tokens: int, prefill_hit_tokens: int = 0,
) -> Decision:  # fmt: skip
    """P/D or decode alone for one request, given what decode and prefill already hold (module doc)."""
    if rule == "always":
        return Decision("pd", ALWAYS)
    lacking = max(0, prompt_tokens - decode_hit_tokens)
    held = decode_hit_tokens / prompt_tokens if prompt_tokens else 0.0
    cheap = lacking < min_prefill_tokens or (decode_hit_tokens > 0 and held >= decode_hit_fraction)
    if not cheap:
        return Decision("pd", PREFILL_PAYS)
    if prefill_hit_tokens > decode_hit_tokens:
        return Decision("pd", PREFILL_HOLDS_MORE)
    return Decision("decode_only", DECODE_HOLDS_PREFIX if decode_hit_tokens else SHORT_PROMPT)
