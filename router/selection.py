"""Selection step: choose the decode engine (load-aware) and a prefill engine of the same revision.

Push modes pick D when the request arrives, before any KV exists, so D's load is all the router can
go on: requests it has in flight on D (known exactly), plus D's own waiting queue and KV-cache usage
scraped from its /metrics (where visible). P and D of different revisions are never paired: during
a rollout a new-revision D may use a different model, block size or connector than an old P.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.router import scoring, topology
from kvferry.router.config import Endpoint
from kvferry.router.discovery import Pool
from kvferry.router.prefix import PrefixIndex, PromptKeys


class NoBackendError(Exception):
    """No usable engine pair; the message says which role is missing."""


class OverloadedError(Exception):
    """The request cannot be taken now (429): every engine of a role is at its in-flight limit
    (`at_limit`), or the prefill engine would start it too late (routing.py)."""

    def __init__(self, role: str, message: str, limit: str) -> None:
        super().__init__(f"{message}; retry after a moment")
        self.role = role
        self.limit = limit  # the limits key that refused it: max_in_flight_per_engine, max_prefill_wait_s

    @classmethod
    def at_limit(cls, role: str, limit: int) -> OverloadedError:
        message = f"every {role} engine is at its limit of {limit} requests in flight"
        return cls(role, message, "max_in_flight_per_engine")


@dataclass
class EngineLoad:
    """What the router knows about one engine's load."""

    in_flight: int = 0
    waiting: float = 0.0  # vllm:num_requests_waiting, from the last scrape
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1), from the last scrape
    down_until: float = 0.0  # monotonic time; set after a connection failure


@dataclass
class LoadTracker:
    """In-flight counts, scraped load and short cool-downs after failures, keyed by engine URL."""

    cooldown_s: float = 5.0
    loads: dict[str, EngineLoad] = field(default_factory=lambda: defaultdict(EngineLoad))

    def begin(self, ep: Endpoint) -> None:
        self.loads[ep.url].in_flight += 1

    def end(self, ep: Endpoint) -> None:
        load = self.loads.get(ep.url)
        if load is not None:
            load.in_flight = max(0, load.in_flight - 1)

    def prune(self, pool: Pool) -> None:
        """Forget engines that left the pool (pods come and go: without this the dict grows with every
        pod ever seen); an engine with legs still in flight stays until they end."""
        current = {e.url for e in (*pool.prefill, *pool.decode)}
        for url in [u for u, load in self.loads.items() if u not in current and load.in_flight == 0]:
            del self.loads[url]

    def mark_down(self, ep: Endpoint, now: float | None = None) -> None:
        self.loads[ep.url].down_until = (time.monotonic() if now is None else now) + self.cooldown_s

    def has_room(self, ep: Endpoint, limit: int) -> bool:
        return self.loads[ep.url].in_flight < limit

    def is_up(self, ep: Endpoint, now: float | None = None) -> bool:
        return self.loads[ep.url].down_until <= (time.monotonic() if now is None else now)

    def observe(self, ep: Endpoint, waiting: float, kv_usage: float) -> None:
        load = self.loads[ep.url]
        load.waiting, load.kv_usage = waiting, kv_usage

    def load(self, ep: Endpoint) -> float:
        """Requests the router sent plus the engine's own queue."""
        load = self.loads[ep.url]
        return load.in_flight + load.waiting

    def score(self, ep: Endpoint) -> tuple[float, float, str]:
        load = self.loads[ep.url]
        # Requests the router sent plus the engine's own queue; then the fuller KV cache loses ties,
        # since a push D that cannot allocate blocks cannot register and P's lease runs out.
        return (load.in_flight + load.waiting, load.kv_usage, ep.engine_id)


@dataclass(frozen=True)
class Choice:
    """A (prefill, decode) pair and how many leading blocks of the prompt each holds (prefix index)."""

    prefill: Endpoint
    decode: Endpoint
    prefill_hit_blocks: int = 0
    decode_hit_blocks: int = 0


class Selector:
    """Chooses (prefill, decode) pairs by policy over the current pool; with a prefix index, least-loaded
    prefers the engine holding the longest prefix of the prompt within `load_bound` (scoring.py)."""

    def __init__(
        self, policy: str, tracker: LoadTracker, max_in_flight: int = 256,
        index: PrefixIndex | None = None, load_bound: float = 0.0,
    ) -> None:  # fmt: skip
        self.policy = policy
        self.tracker = tracker
        self.max_in_flight = max_in_flight
        self.index = index
        self.load_bound = load_bound
        self._rr = {role: itertools.count() for role in ("prefill", "decode")}

    def _usable(self, endpoints: list[Endpoint], now: float) -> list[Endpoint]:
        up = [e for e in endpoints if self.tracker.is_up(e, now)]
        # When every engine of a role is cooling down, try them anyway: an error beats a refusal.
        return up or list(endpoints)

    def _with_room(self, endpoints: list[Endpoint], role: str) -> list[Endpoint]:
        roomy = [e for e in endpoints if self.tracker.has_room(e, self.max_in_flight)]
        if not roomy:
            raise OverloadedError.at_limit(role, self.max_in_flight)
        return roomy

    def choose(self, pool: Pool, now: float | None = None) -> tuple[Endpoint, Endpoint]:
        choice = self.choose_for(pool, None, now)
        return choice.prefill, choice.decode

    def choose_for(self, pool: Pool, keys: PromptKeys | None, now: float | None = None) -> Choice:
        """The pair for a prompt with these block keys (None: by load alone)."""
        now = time.monotonic() if now is None else now
        if not pool.decode:
            raise NoBackendError("no decode engine is available")
        if not pool.prefill:
            raise NoBackendError("no prefill engine is available")
        prefill_revisions = {p.revision for p in pool.prefill}
        decodes = [d for d in pool.decode if d.revision in prefill_revisions]
        if not decodes:
            raise NoBackendError(
                f"no decode engine shares a revision with a prefill engine "
                f"(prefill revisions {sorted(prefill_revisions)}, "
                f"decode revisions {sorted({d.revision for d in pool.decode})})"
            )
        decodes = self._with_room(decodes, "decode")
        prefills = self._with_room(list(pool.prefill), "prefill")
        # Only revisions whose P has room: a D paired with no free P would be refused anyway.
        revisions = {p.revision for p in prefills}
        paired = [d for d in decodes if d.revision in revisions]
        if not paired:
            raise OverloadedError.at_limit("prefill", self.max_in_flight)
        prefills = self._usable(prefills, now)

        # D's closeness: to the nearest P it could pair with; P's: to the chosen D (topology.py).
        def nearest_p(d: Endpoint) -> int:
            return max(
                topology.closeness(d.topology, p.topology) for p in prefills if p.revision == d.revision
            )

        decode, decode_hit = self._pick(self._usable(paired, now), keys, nearest_p)
        prefills = [p for p in prefills if p.revision == decode.revision]
        prefill, prefill_hit = self._pick(
            prefills, keys, lambda p: topology.closeness(p.topology, decode.topology)
        )
        return Choice(prefill, decode, prefill_hit, decode_hit)

    def _pick(
        self, candidates: list[Endpoint], keys: PromptKeys | None, close: Callable[[Endpoint], int]
    ) -> tuple[Endpoint, int]:
        index = self.index

        def held(e: Endpoint) -> int:
            return index.match(e.url, keys.keys) if index is not None and keys is not None else 0

        if self.policy == "round-robin":
            ordered = sorted(candidates, key=lambda e: e.engine_id)
            chosen = ordered[next(self._rr[ordered[0].role]) % len(ordered)]
            return chosen, held(chosen)
        scored = [
            scoring.Candidate(e, self.tracker.load(e), self.tracker.score(e), held(e), close(e))
            for e in candidates
        ]
        best = scoring.pick(scored, self.load_bound)
        return best.endpoint, best.hit_blocks
