"""Metrics step: the `kvferry_` Prometheus metrics (documented one by one in docs/metrics.md).

One table (`SPECS`) defines every metric; names come from kvferry.contracts.metrics, which the operator
reads too. `Metrics` records into prometheus_client objects in its own registry (tests, demo,
benchmark) and, when asked, into a journal of updates. Inside vLLM the worker process cannot serve
/metrics, so the worker ships its journal through vLLM's connector stats (`KvferryStats`,
connector.py) and the API server replays it with `apply()` onto metrics created with vLLM's own
metric classes and labels (`build()` with `extra_labels`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from kvferry.contracts import metrics as names
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Every failure reason either side can name (docs/metrics.md). A producer's Failure carries its reason
# to the consumer, which reports it: a label value a peer chooses, so anything else counts as "other"
# (a made-up reason per message would otherwise create a time series per message).
FAILURE_REASONS = frozenset(
    (
        "cancelled", "deadline", "duplicate", "failed", "handshake_failed", "held_full", "lease_expired",
        "malformed", "model_mismatch", "null_block", "overflow", "overloaded", "prefill_aborted",
        "producer_gone", "producer_overloaded", "registration_expired", "rejected", "superseded",
        "token_mismatch", "transfer_failed", "write_failed", "write_stuck", "wrong_revision",
        names.LAYOUT_MISMATCH,
        names.SAMPLE_MISMATCH,
    )
)  # fmt: skip


def failure_reason(reason: str) -> str:
    """The `reason` label of a failure: one of FAILURE_REASONS or "other"."""
    return reason if reason in FAILURE_REASONS else "other"


_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class Spec:
    attr: str
    kind: type
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


SPECS = (
    Spec(
        "sentinel",
        Counter,
        names.SENTINEL_CHECKS,
        "Consumer: sampled KV checks when a WRITE landed (sentinel.py), by result (ok, mismatch)",
        ("result",),
    ),
    Spec(
        "transfers",
        Counter,
        names.TRANSFERS,
        "Completed KV transfers (producer: WRITEs to one consumer rank; consumer: requests fully received)",
        ("role",),
    ),
    Spec(
        "failures",
        Counter,
        names.TRANSFER_FAILURES,
        "KV transfers that failed, by reason",
        ("role", names.REASON),
    ),
    Spec(
        "rejected",
        Counter,
        names.REJECTED_MESSAGES,
        "Inputs ignored and not acted on (malformed, "
        "unknown request, duplicate, superseded, unexpected engine, ...)",
        ("role", "reason"),
    ),
    Spec(
        "bytes",
        Counter,
        names.TRANSFER_BYTES,
        "Bytes moved by completed WRITEs, by the NIXL backend that moved them",
        ("role", names.BACKEND),
    ),
    Spec(
        "descriptors",
        Histogram,
        names.DESCRIPTORS_PER_TRANSFER,
        "NIXL descriptors per WRITE",
        ("mode",),
        _COUNTS,
    ),
    Spec(
        "prep_seconds",
        Histogram,
        names.DESCRIPTOR_PREP_SECONDS,
        "Time to map blocks and build the descriptors of one WRITE",
        ("mode",),
        _SECONDS,
    ),
    Spec(
        "reg_to_match",
        Histogram,
        names.REGISTRATION_TO_MATCH_SECONDS,
        "Producer: how long a finished prefill waited for its registration (0: the registration came first)",
        (),
        _SECONDS,
    ),
    Spec(
        "match_to_done",
        Histogram,
        names.MATCH_TO_DONE_SECONDS,
        "Producer: WRITE start to completion",
        (),
        _SECONDS,
    ),
    Spec(
        "handoffs",
        Counter,
        names.PREFILL_HANDOFFS,
        "Producer: prefill legs handed to the endpoint to push, by when "
        "(after_forward: right after the forward that wrote their KV; finished: from request_finished)",
        ("when",),
    ),
    Spec(
        "prefix_held",
        Counter,
        names.PREFIX_TOKENS_HELD,
        "Consumer: prompt tokens decode already held in its own prefix cache, so not registered and not "
        "pushed (counted once per request, on TP rank 0)",
        (),
    ),
    Spec(
        "pushed_tokens",
        Counter,
        names.PUSHED_TOKENS,
        "Producer: prompt tokens written by completed WRITEs (per consumer rank written)",
        (),
    ),
    Spec(
        "pushed_blocks",
        Counter,
        names.PUSHED_BLOCKS,
        "Producer: consumer KV blocks written into by completed WRITEs (per consumer rank written)",
        (),
    ),
    Spec(
        "receive_wait",
        Histogram,
        names.RECEIVE_WAIT_SECONDS,
        "Consumer: expectation to all KV received",
        (),
        _SECONDS,
    ),
    Spec(
        "pending",
        Gauge,
        names.PENDING,
        "Entries in the connector's bounded maps",
        ("role", "kind", "tp_rank"),
    ),
    Spec(
        "endpoint_rounds",
        Counter,
        names.ENDPOINT_ROUNDS,
        "Rounds (wake-ups) of the endpoint thread (connector/endpoint.py)",
        ("role",),
    ),
    Spec(
        "endpoint_cpu",
        Counter,
        names.ENDPOINT_CPU_SECONDS,
        "CPU time of the endpoint thread (what it takes from the engine's core)",
        ("role",),
    ),
    Spec(
        "step_hook_seconds",
        Counter,
        names.STEP_HOOK_SECONDS,
        "Time spent in the connector's per-step hooks on vLLM's worker thread (divide by kvferry_steps)",
        ("role",),
    ),
    Spec("steps", Counter, names.STEPS, "Engine steps the connector's worker hooks ran in", ("role",)),
    Spec("handshakes", Counter, names.HANDSHAKES, "Side-channel peer metadata fetches", ("result",)),
    Spec(
        "transfer_auth",
        Gauge,
        names.TRANSFER_AUTH,
        "1 on this rank's side-channel auth mode: token (the CR's transfer token, which clients must "
        "prove) or none (unauthenticated: no KVFERRY_TRANSFER_TOKEN_FILE)",
        ("mode",),
    ),
    Spec(
        "side_auth_failures",
        Counter,
        names.SIDE_AUTH_FAILURES,
        "Side-channel clients closed without an answer, by reason (bad_proof: not this CR's transfer "
        "token; malformed; timeout: no complete request within its time)",
        ("reason",),
    ),
    Spec(
        "probes",
        Counter,
        names.PRODUCER_PROBES,
        "Consumer: side-channel checks of producer ranks a held receive waits for (gone, alive, unknown)",
        ("result",),
    ),
    Spec(
        "preflight",
        Gauge,
        names.PREFLIGHT_OK,
        "1 if a start-up check passed (NIXL backend created, EFA device present for LIBFABRIC), else 0",
        (names.CHECK,),
    ),
)


def build(
    kinds: dict[type, type], registry: CollectorRegistry | None, extra_labels: tuple[str, ...] = ()
) -> dict:
    """Create every metric with the given classes (prometheus_client's, or vLLM's wrappers)."""
    out = {}
    for s in SPECS:
        kw: dict[str, Any] = {"registry": registry} if registry is not None else {}
        if s.buckets:
            kw["buckets"] = s.buckets
        labels = [*extra_labels, *s.labels]
        out[s.attr] = kinds[s.kind](name=s.name, documentation=s.help, labelnames=labels, **kw)
    return out


_OPS = {Counter: "inc", Histogram: "observe", Gauge: "set"}
_KIND = {s.attr: s.kind for s in SPECS}


def apply(metrics: dict, journal: list[list[Any]], extra_values: tuple[Any, ...] = ()) -> None:
    """Replay journal entries [attr, labels, value] onto metrics made by `build`."""
    for attr, labels, value in journal:
        if attr not in metrics:
            continue  # a newer worker's metric this process does not know yet
        metric = metrics[attr].labels(*extra_values, *labels) if (extra_values or labels) else metrics[attr]
        getattr(metric, _OPS[_KIND[attr]])(value)


class Metrics:
    """The endpoint's recorder: `record(attr, value, *labels)`."""

    def __init__(self, registry: CollectorRegistry | None = None, journal: bool = False) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._m = build({Counter: Counter, Histogram: Histogram, Gauge: Gauge}, self.registry)
        self._journal: list[list[Any]] | None = [] if journal else None
        self._lock = threading.Lock()  # the side channel's thread records too

    def record(self, attr: str, value: float, *labels: str) -> None:
        if attr == "failures" and len(labels) == 2:  # (role, reason): a peer may name the reason
            labels = (labels[0], failure_reason(labels[1]))
        apply(self._m, [[attr, list(labels), value]])
        if self._journal is not None:
            with self._lock:
                self._journal.append([attr, list(labels), value])

    def take_journal(self) -> list[list[Any]]:
        with self._lock:
            out, self._journal = self._journal or [], [] if self._journal is not None else None
        return out
