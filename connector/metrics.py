"""Metrics step: the `kvferry_` Prometheus metrics (documented one by one in docs/metrics.md).

Each `Metrics` owns its registry by default so several endpoints can live in one process (tests,
demo); inside vLLM the worker passes the registry that vLLM's /metrics exposes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.transfers = Counter(
            "kvferry_transfers",
            "Completed KV transfers (producer: writes to one "
            "consumer rank; consumer: requests fully received)",
            ["role"],
            registry=r,
        )
        self.failures = Counter(
            "kvferry_transfer_failures", "KV transfers that failed, by reason", ["role", "reason"], registry=r
        )
        self.rejected = Counter(
            "kvferry_rejected_messages",
            "Inputs ignored (malformed, unknown request, duplicate, superseded, unexpected engine...)",
            ["role", "reason"],
            registry=r,
        )
        self.bytes = Counter(
            "kvferry_transfer_bytes", "Bytes written by WRITEs (producer) ", ["role"], registry=r
        )
        self.descriptors = Histogram(
            "kvferry_descriptors_per_transfer",
            "NIXL descriptors per WRITE",
            ["mode"],
            buckets=_COUNTS,
            registry=r,
        )
        self.prep_seconds = Histogram(
            "kvferry_descriptor_prep_seconds",
            "Time to map blocks and build the descriptors of one WRITE",
            ["mode"],
            buckets=_SECONDS,
            registry=r,
        )
        self.reg_to_match = Histogram(
            "kvferry_registration_to_match_seconds",
            "Producer: wait of the earlier of registration and prefill-finished for the other",
            buckets=_SECONDS,
            registry=r,
        )
        self.match_to_done = Histogram(
            "kvferry_match_to_done_seconds",
            "Producer: match to WRITE completion (includes a first-contact handshake)",
            buckets=_SECONDS,
            registry=r,
        )
        self.receive_wait = Histogram(
            "kvferry_receive_wait_seconds",
            "Consumer: expectation to all KV received",
            buckets=_SECONDS,
            registry=r,
        )
        self.pending = Gauge(
            "kvferry_pending", "Entries in the connector's bounded maps", ["role", "kind"], registry=r
        )
        self.handshakes = Counter(
            "kvferry_handshakes", "Side-channel peer metadata fetches", ["result"], registry=r
        )

    def set_pending(self, role: str, counts: dict[str, int]) -> None:
        for kind, n in counts.items():
            self.pending.labels(role, kind).set(n)
