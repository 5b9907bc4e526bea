"""Actions step: what the protocol cores (protocol.py) ask their caller to carry out, and their key.

Every core input returns a list of these: the endpoint thread sends the notifications, starts the
WRITEs, releases blocks and reports results; the cores themselves do no I/O. Pure, like the cores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.connector.wire import Registration

Key = tuple[str, int]  # (request_id, attempt)


@dataclass(frozen=True)
class StartWrite:
    """Producer: write tokens [reg.first_token, num_tokens) of `block_ids` (the prompt's blocks from
    token 0) to the consumer rank named in `reg` (whose block ids start at reg.first_token)."""

    key: Key
    reg: Registration
    block_ids: list[list[int]]
    num_tokens: int
    registration_to_match_s: float  # how long the finished prefill waited (0: registration came first)
    deadline: float = float("inf")  # the consumer's deadline (local clock): re-checked before posting


@dataclass(frozen=True)
class SendFailure:
    """Producer: tell the consumer rank of `reg` that it will not get this KV, and why. Unless
    `verified` (our prefill named this key and this consumer engine), the endpoint sends it only to
    a peer it already knows: a registration an unknown sender makes up never draws a handshake to
    whatever address it names (the consumer then ends at its own deadline)."""

    reg: Registration
    reason: str
    verified: bool = field(default=True, compare=False)


@dataclass(frozen=True)
class Release:
    """Producer: the source blocks of `key` may be freed (reason: sent, lease_expired, ...)."""

    key: Key
    reason: str


@dataclass(frozen=True)
class Reject:
    """Either side: an input was ignored (reason is a metric label, detail is for the log)."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Register:
    """Consumer: send the registration for `key` to these producer ranks."""

    key: Key
    producer_ranks: tuple[int, ...]


@dataclass(frozen=True)
class SendCancel:
    """Consumer: tell these producer ranks not to start writing `key`."""

    key: Key
    producer_ranks: tuple[int, ...]


@dataclass(frozen=True)
class NothingInFlight:
    """Producer: no WRITE of `key` to this consumer rank is or will be in flight (its Cancel named a
    key we hold nothing of for it): answer the canceller with a Failure so it can free its blocks."""

    key: Key
    consumer_rank: int


@dataclass(frozen=True)
class ProbeProducers:
    """Consumer: `key` is held past its deadline + grace with these producer ranks silent: check
    each one's side channel (gone, or alive and to be cancelled again)."""

    key: Key
    producer_ranks: tuple[int, ...]


@dataclass(frozen=True)
class Received:
    """Consumer: all KV of `key` has landed."""

    key: Key
    wait_s: float


@dataclass(frozen=True)
class Failed:
    """Consumer: `key` will not be (fully) received; the caller reports a load failure."""

    key: Key
    reason: str


Action = (
    StartWrite
    | SendFailure
    | Release
    | Reject
    | Register
    | SendCancel
    | NothingInFlight
    | ProbeProducers
    | Received
    | Failed
)
