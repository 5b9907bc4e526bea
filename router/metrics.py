"""Router metrics step: the kvferry_router_* Prometheus series, in a registry per router instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    """All router series. Labels stay low-cardinality: engine ids, never request ids."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvferry_router_requests", "Client requests by endpoint and outcome (ok, recomputed, error, "
            "client_disconnect, overloaded, recompute_budget_exhausted)", ["endpoint", "mode", "outcome"],
            registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "kvferry_router_request_duration_seconds", "Client request wall time", ["endpoint", "mode"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvferry_router_ttft_seconds", "Arrival to the first decode byte sent to the client",
            ["mode"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.leg_errors = Counter(
            "kvferry_router_leg_errors", "Failed legs by leg (prefill, decode) and reason",
            ["leg", "reason"], registry=r,
        )  # fmt: skip
        self.recomputes = Counter(
            "kvferry_router_recomputes", "Requests answered by a local recompute after a leg failed",
            ["reason"], registry=r,
        )  # fmt: skip
        self.decode_delay = Histogram(
            "kvferry_router_decode_delay_seconds", "push.decode_start before-prefill: how long decode's "
            "leg waited for prefill to be about to start the request", buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.first_token_from_prefill = Counter(
            "kvferry_router_first_token_from_prefill", "streaming.first_token prefill: streams started "
            "with prefill's token (before decode's)", registry=r,
        )  # fmt: skip
        self.shed = Counter(
            "kvferry_router_shed", "Requests refused with 429 before any engine saw them, by the role "
            "whose limit refused them and the limits key (max_in_flight_per_engine, max_prefill_wait_s)",
            ["role", "limit"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "kvferry_router_in_flight", "Legs in flight per engine", ["role", "engine_id"], registry=r
        )
        self.engines = Gauge("kvferry_router_engines", "Engines in the current pool", ["role"], registry=r)
        self.background_prefills = Gauge(
            "kvferry_router_detached_prefills",
            "Prefill legs left to finish after their client went away (never cancelled: that strands decode)",
            registry=r,
        )
        self.served = Counter(
            "kvferry_router_served", "Requests by how they were served: path pd (prefill and decode) or "
            "decode_only (decode prefills locally), and why (always, prefill_pays, prefill_holds_more, "
            "short_prompt, decode_holds_prefix)", ["path", "reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvferry_router_prompt_tokens", "Prompt tokens routed, by role of the engine that got them "
            "(text prompts: estimated from characters)", ["role"], registry=r,
        )  # fmt: skip
        self.prefix_hit_tokens = Counter(
            "kvferry_router_prefix_hit_tokens", "Of those, tokens the chosen engine already held by the "
            "router's prefix index (its hit rate: hit / prompt tokens per role)", ["role"], registry=r,
        )  # fmt: skip
        self.kv_event_blocks = Counter(
            "kvferry_router_kv_event_blocks", "Blocks the engines' KV-cache events reported, applied to the "
            "prefix index: stored, removed, or skipped (unknown parent, other block size, LoRA or extra "
            "keys)", ["role", "change"], registry=r,
        )  # fmt: skip
        self.kv_event_resyncs = Counter(
            "kvferry_router_kv_event_resyncs", "Times an engine's event stream was re-read from its replay "
            "buffer (where it has one): connect (first read), gap (batches missed), restart (sequence "
            "went back), reconnect (the connection dropped, e.g. after a frame past the size cap)",
            ["role", "reason"], registry=r,
        )  # fmt: skip
        self.kv_event_dropped = Counter(
            "kvferry_router_kv_event_dropped", "KV-cache event input dropped: malformed (a frame that is "
            "not a vLLM batch, or more than kvevents.MAX_BATCH_EVENTS events), refused (an event past a "
            "size bound: hash bytes, blocks or tokens per event), unknown (an event type this router does "
            "not know)", ["role", "reason"], registry=r,
        )  # fmt: skip
        self.kv_event_engines = Gauge(
            "kvferry_router_kv_event_engines", "Engines whose KV-cache events this router follows",
            ["role"], registry=r,
        )  # fmt: skip
        self.errors_by_status = Counter(
            "kvferry_router_errors", "Error responses by HTTP status", ["status"], registry=r
        )

    def forget_engines(self, keep: set[tuple[str, str]]) -> None:
        """Drop the in-flight series of engines that left the pool with nothing in flight: pods come
        and go, and a series per pod ever seen would grow the scrape without bound."""
        values = {
            (s.labels["role"], s.labels["engine_id"]): s.value
            for metric in self.in_flight.collect()
            for s in metric.samples
        }
        for labels, value in values.items():
            if labels not in keep and value == 0:
                self.in_flight.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
