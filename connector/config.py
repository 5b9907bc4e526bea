"""Configuration step: `kv_connector_extra_config` -> a validated `KvferryConfig`, with clear errors.

Each field's type says what it takes (msgspec checks it: ints are never bools, bounds by msgspec.Meta;
a Meta description names what a field is, for its error). Defaults are right for EFA (backend
LIBFABRIC: UCX silently falls back to TCP there). On a CPU box or in these tests use
`{"backends": ["UCX"]}`; docs/metrics.md and connector/README.md say so.
"""

from __future__ import annotations

import difflib
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

Backend = Literal["LIBFABRIC", "UCX"]
KNOWN_BACKENDS: tuple[str, ...] = typing.get_args(Backend)
# auto: prepped (reused) lists when both sides share a per-block layout, else coalesced per request;
# prepped / coalesced / units (one descriptor per token run and head, no merging) force one.
Descriptors = Literal["auto", "prepped", "coalesced", "units"]
DESCRIPTOR_MODES: tuple[str, ...] = typing.get_args(Descriptors)

Seconds = Annotated[float, msgspec.Meta(gt=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
TcpPort = Annotated[int, msgspec.Meta(ge=0, le=65535, description="a TCP port")]


class ConfigError(ValueError):
    """A bad extra_config key or value; the message names it."""


@dataclass(frozen=True)
class KvferryConfig:
    # NIXL backends, in order (one name is a list of one; any case)
    backends: Annotated[
        list[Backend], msgspec.Meta(min_length=1, description=f"a non-empty list of {KNOWN_BACKENDS}")
    ] = field(default_factory=lambda: ["LIBFABRIC"])
    side_channel_host: str = "127.0.0.1"  # bound and advertised: the pod IP in Kubernetes
    side_channel_port: TcpPort = 5600  # TP rank r serves its agent metadata on port + r (0: any free port)
    # Deployment revision (the operator sets kvferry.io/revision): peers of another revision are rejected.
    revision: str = ""
    lease_s: Seconds = 30.0  # producer: finished blocks wait this long for a registration
    deadline_s: Seconds = 30.0  # consumer: default wait for KV when a request does not say
    registration_ttl_s: Seconds = 60.0  # producer: a registration waits this long for its prefill
    # consumer: blocks of a receive past its deadline stay held this much longer for the producer's
    # answer to the Cancel (covers a WRITE posted just before the deadline and clock skew between hosts);
    # producer: a WRITE still running at the consumer's deadline + grace_s / 2 fences the rank
    # (writes.py). Both roles read the same value (the operator renders one config).
    grace_s: Seconds = 2.0
    peer_idle_s: Seconds = 600.0  # a peer agent unused this long is unloaded (pods come and go)
    max_entries: AtLeastOne = 4096  # bound of every pending map
    descriptors: Annotated[Descriptors, msgspec.Meta(description=f"one of {DESCRIPTOR_MODES}")] = "auto"
    # Transport poll interval right after activity and while a WRITE is in flight; backs off to 8x
    # while transfers are pending. Without a UCX progress thread a WRITE's rendezvous and its notice
    # advance only when polled, so this bounds each hop (2 ms made a 256-token WRITE take 6 ms instead
    # of 3; bench/results/README.md). It was 2 ms while vLLM's queue spin starved the endpoint thread.
    poll_min_s: Seconds = 0.0002
    poll_max_s: Seconds = 0.01  # poll interval while something is pending (e.g. held blocks await D)
    # Consumer: who runs the rounds that notice KV landed. "step": the engine's steps do (each step with
    # receives pending runs one round and takes its results; timer polls only back that up, at
    # poll_max_s), so decode's core is not woken between steps, where the engine could not act on the
    # news anyway. "timer": the endpoint polls on its own from poll_min_s up, and steps only kick.
    consumer_rounds: Literal["step", "timer"] = "step"
    # nothing pending at all: the endpoint thread sleeps this long between housekeeping rounds (any
    # command wakes it at once); poll_max_s here restores the old always-polling behaviour
    idle_tick_s: Seconds = 1.0
    handshake_timeout_s: Seconds = 5.0  # per side-channel attempt
    handshake_attempts: AtLeastOne = 3  # with exponential backoff between attempts
    progress_thread: bool = False  # UCX progress thread: busy-spins about one core when idle
    num_threads: NonNegative = 0  # backend worker threads (0 = backend default)
    # Read-back verification (tests, diagnosis; costs a copy of each request's KV): each rank writes
    # the KV of every request it hands over (producer) or receives (consumer), read element by element
    # through its own layout, to DIR/<request>-<attempt>-<role>-h<first head>.npy.
    kv_dump_dir: str = ""
    # Stage KV through host memory (staging.py). On by itself for GPU caches when vLLM's
    # kv_buffer_device is "cpu" (nodes without GPUDirect RDMA); true forces it for host caches too
    # (tests: the same copies on vLLM-CPU).
    host_staging: bool = False
    # Sentinel (sentinel.py): one request in N has a few tokens' KV digested by prefill and checked by
    # decode when it lands (a mismatch fails the receive: sample_mismatch); 0 turns it off.
    sentinel_every: NonNegative = 8

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KvferryConfig:
        """Parse extra_config; unknown keys and bad values are errors naming the key."""
        hints = typing.get_type_hints(cls, include_extras=True)
        values: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if key not in hints:
                hint = difflib.get_close_matches(key, hints, n=1)
                raise ConfigError(
                    f"kv_connector_extra_config: unknown key {key!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                )
            if key == "backends" and isinstance(value, str | list):  # one name or a list, any case
                value = [
                    v.upper() if isinstance(v, str) else v
                    for v in ([value] if isinstance(value, str) else value)
                ]
            try:
                values[key] = msgspec.convert(value, hints[key])
            except msgspec.ValidationError as exc:
                raise _named(exc, key, value, hints[key]) from None
        cfg = cls(**values)
        if cfg.poll_min_s > cfg.poll_max_s:
            raise ConfigError("kv_connector_extra_config.poll_min_s must be <= poll_max_s")
        return cfg


_KINDS = {"bool": "true/false", "str": "a string", "array": "a list", "object": "a map"}


def _named(exc: msgspec.ValidationError, key: str, value: Any, hint: Any) -> ConfigError:
    """msgspec's `Expected `float` > 0.0` -> `kv_connector_extra_config.lease_s must be > 0.0, got 0`."""
    where, what = f"kv_connector_extra_config.{key}", str(exc)
    described = [m.description for m in getattr(hint, "__metadata__", ()) if getattr(m, "description", None)]
    if described:
        return ConfigError(f"{where}={value!r} is not {described[0]}")
    if m := re.fullmatch(r"Expected `(\w+)`, got `\w+`", what):
        return ConfigError(f"{where}: expected {_KINDS.get(m[1], m[1])}, got {value!r}")
    if m := re.fullmatch(r"Expected `\w+` (.+)", what):
        return ConfigError(f"{where} must be {m[1]}, got {value!r}")
    return ConfigError(f"{where}={value!r}: {what}")
