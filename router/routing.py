"""Routing step: per request, the prompt's block keys, the engine pair, P/D or decode alone, and the
record of what each chosen engine now holds (router/prefix.py, scoring.py, selection.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.router import scoring
from kvferry.router.backlog import PrefillBacklog
from kvferry.router.config import Routing
from kvferry.router.discovery import Pool
from kvferry.router.metrics import RouterMetrics
from kvferry.router.params import ClientRequest
from kvferry.router.prefix import PrefixIndex, PromptKeys, prompt_keys, prompt_text
from kvferry.router.selection import Choice, OverloadedError, Selector


@dataclass(frozen=True)
class Plan:
    choice: Choice
    decision: scoring.Decision
    keys: PromptKeys

    @property
    def decode_only(self) -> bool:
        return self.decision.path == "decode_only"

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens prefill computes (the prefix it holds excluded)."""
        return self.keys.tokens - self.keys.hit_tokens(self.choice.prefill_hit_blocks)


class Planner:
    """Plans each request over the current pool and keeps the prefix index up to date."""

    def __init__(
        self, routing: Routing, selector: Selector, index: PrefixIndex | None, metrics: RouterMetrics,
        backlog: PrefillBacklog, max_prefill_wait_s: float,
    ) -> None:  # fmt: skip
        self.routing = routing
        self.selector = selector
        self.index = index
        self.metrics = metrics
        self.backlog = backlog
        self.max_prefill_wait_s = max_prefill_wait_s

    def plan(self, pool: Pool, req: ClientRequest) -> Plan:
        r = self.routing
        keys = prompt_keys(prompt_text(req.path, req.body), r.block_tokens, r.chars_per_token)
        choice = self.selector.choose_for(pool, keys if self.index is not None else None)
        d = r.disaggregation
        d_hit, p_hit = keys.hit_tokens(choice.decode_hit_blocks), keys.hit_tokens(choice.prefill_hit_blocks)
        decision = scoring.decide(
            d.rule, d.min_prefill_tokens, d.decode_hit_fraction, keys.tokens, d_hit, p_hit
        )
        plan = Plan(choice, decision, keys)
        if not plan.decode_only:
            self._admit(choice.prefill.url, choice.prefill.engine_id, plan.prefill_tokens)
        self._account(plan)
        return plan

    def _admit(self, url: str, engine_id: str, tokens: int) -> None:
        """Refuse now what the prefill engine could not start within the limit (429, nothing spent)."""
        wait, limit = self.backlog.wait_s(url, tokens), self.max_prefill_wait_s
        if wait is not None and wait > limit:
            why = f"prefill {engine_id} would start this request in ~{wait:.1f}s, over the limit of "
            raise OverloadedError(
                "prefill", f"{why}{limit:g}s (limits.max_prefill_wait_s)", "max_prefill_wait_s"
            )

    def _account(self, plan: Plan) -> None:
        """Count how the request is served and what the chosen engines held; record that they hold it
        now (decode always gets the whole prompt: received as KV, or computed itself)."""
        choice, keys = plan.choice, plan.keys
        self.metrics.served.labels(plan.decision.path, plan.decision.reason).inc()
        engines = [(choice.decode, choice.decode_hit_blocks)]
        if not plan.decode_only:
            engines.append((choice.prefill, choice.prefill_hit_blocks))
        for engine, hit_blocks in engines:
            self.metrics.prompt_tokens.labels(engine.role).inc(keys.tokens)
            self.metrics.prefix_hit_tokens.labels(engine.role).inc(keys.hit_tokens(hit_blocks))
            if self.index is not None:
                self.index.record(engine.url, keys.keys)

    def forget(self, pool: Pool) -> None:
        """Drop the index entries of engines that left the pool."""
        urls = {e.url for e in (*pool.prefill, *pool.decode)}
        if self.index is not None:
            self.index.forget(urls)
        self.backlog.forget(urls)
