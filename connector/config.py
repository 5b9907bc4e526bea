"""Configuration step: `kv_connector_extra_config` -> a validated `KvferryConfig`, with clear errors.

Defaults are right for EFA (backend LIBFABRIC: UCX silently falls back to TCP there). On a CPU box
or in these tests use `{"backends": ["UCX"]}`; docs/metrics.md and connector/README.md say so.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

KNOWN_BACKENDS = ("LIBFABRIC", "UCX")
# auto: prepped (reused) lists when both sides share a per-block layout, else coalesced per request;
# prepped / coalesced / units (one descriptor per token run and head, no merging) force one.
DESCRIPTOR_MODES = ("auto", "prepped", "coalesced", "units")


class ConfigError(ValueError):
    """A bad extra_config key or value; the message names it."""


@dataclass(frozen=True)
class KvferryConfig:
    backends: list[str] = field(default_factory=lambda: ["LIBFABRIC"])  # NIXL backends, in order
    side_channel_host: str = "127.0.0.1"  # bound and advertised: the pod IP in Kubernetes
    side_channel_port: int = 5600  # TP rank r serves its agent metadata on port + r (0: any free port)
    # Deployment revision (the operator sets kvferry.io/revision): peers of another revision are rejected.
    revision: str = ""
    lease_s: float = 30.0  # producer: finished blocks wait this long for a registration
    deadline_s: float = 30.0  # consumer: default wait for KV when a request does not say
    registration_ttl_s: float = 60.0  # producer: a registration waits this long for its prefill
    # consumer: blocks of a receive past its deadline stay held this much longer for the producer's
    # answer to the Cancel (covers a WRITE posted just before the deadline and clock skew between hosts)
    grace_s: float = 2.0
    peer_idle_s: float = 600.0  # a peer agent unused this long is unloaded (pods come and go)
    max_entries: int = 4096  # bound of every pending map
    descriptors: str = "auto"  # auto: prepped lists when block layouts match, else coalesced per request
    # Transport poll interval right after activity and while a WRITE is in flight; backs off to 8x
    # while transfers are pending. Without a UCX progress thread a WRITE's rendezvous and its notice
    # advance only when polled, so this bounds each hop (2 ms made a 256-token WRITE take 6 ms instead
    # of 3; bench/results/README.md). It was 2 ms while vLLM's queue spin starved the endpoint thread.
    poll_min_s: float = 0.0002
    poll_max_s: float = 0.01  # idle poll interval (bounds registration pickup latency when idle)
    handshake_timeout_s: float = 5.0  # per side-channel attempt
    handshake_attempts: int = 3  # with exponential backoff between attempts
    progress_thread: bool = False  # UCX progress thread: busy-spins about one core when idle
    num_threads: int = 0  # backend worker threads (0 = backend default)
    # Read-back verification (tests, diagnosis; costs a copy of each request's KV): each rank writes
    # the KV of every request it hands over (producer) or receives (consumer), read element by element
    # through its own layout, to DIR/<request>-<attempt>-<role>-h<first head>.npy.
    kv_dump_dir: str = ""
    # Stage KV through host memory (staging.py). On by itself for GPU caches when vLLM's
    # kv_buffer_device is "cpu" (nodes without GPUDirect RDMA); true forces it for host caches too
    # (tests: the same copies on vLLM-CPU).
    host_staging: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvferryConfig:
        """Parse extra_config; unknown keys and wrong types are errors naming the key."""
        extra = dict(extra or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if key not in fields:
                hint = difflib.get_close_matches(key, fields, n=1)
                raise ConfigError(
                    f"kv_connector_extra_config: unknown key {key!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                )
            values[key] = _coerce(key, value, fields[key].type)
        cfg = cls(**values)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if not self.backends or any(b not in KNOWN_BACKENDS for b in self.backends):
            raise ConfigError(
                f"kv_connector_extra_config.backends={self.backends!r}: use a non-empty list "
                f"of {KNOWN_BACKENDS}"
            )
        if self.descriptors not in DESCRIPTOR_MODES:
            raise ConfigError(
                f"kv_connector_extra_config.descriptors={self.descriptors!r}: use one of {DESCRIPTOR_MODES}"
            )
        if not 0 <= self.side_channel_port < 65536:
            raise ConfigError(
                f"kv_connector_extra_config.side_channel_port={self.side_channel_port} is not a TCP port"
            )
        for name in (
            "lease_s",
            "deadline_s",
            "registration_ttl_s",
            "poll_min_s",
            "poll_max_s",
            "handshake_timeout_s",
            "grace_s",
            "peer_idle_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kv_connector_extra_config.{name} must be > 0, got {getattr(self, name)}")
        if self.poll_min_s > self.poll_max_s:
            raise ConfigError("kv_connector_extra_config.poll_min_s must be <= poll_max_s")
        if self.max_entries < 1 or self.handshake_attempts < 1 or self.num_threads < 0:
            raise ConfigError(
                "kv_connector_extra_config: max_entries and handshake_attempts must be >= 1, num_threads >= 0"
            )


def _coerce(key: str, value: Any, type_name: Any) -> Any:
    kind = str(type_name)
    where = f"kv_connector_extra_config.{key}"
    if kind.startswith("list"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return [v.upper() for v in value]
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if kind in ("int", "float"):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (kind == "int" and value != int(value))
        ):
            raise ConfigError(f"{where}: expected {kind}, got {value!r}")
        return int(value) if kind == "int" else float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value
