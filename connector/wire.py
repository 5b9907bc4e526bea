"""Wire step: the typed messages kvferry peers exchange, encoded as msgpack with strict decoding.

Every message is `MAGIC + msgpack({"t": <type>, ...fields})`. Decoding checks the magic, the
protocol version, the type, and every field's presence and type, and raises `WireError` naming the
bad field; nothing is read with a silent default.

PROTOCOL_VERSION history (bump on any change to a message below; peers must be equal):
  1. PeerInfo (side channel), Registration (D->P), Done (P->D with each WRITE), Failure (P->D),
     Cancel (D->P).
  2. Registration and Done carry the sender's `revision` (the operator's kvferry.io/revision; "" outside
     Kubernetes): an engine of another revision is rejected (docs/security.md).
  3. PeerInfo.layout is the element-exact layout measured from vLLM (per-plane token and dim offset
     tables, dtype, kind) with its `layout_fingerprint`; Registration carries the consumer's
     fingerprint, so a producer never writes by a layout other than the one the consumer registered.
  4. Registration carries the consumer's absolute deadline (`deadline_unix`, wall clock): the producer
     never starts a WRITE after it. Failure and Cancel carry the sender's `revision` like the others.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
from kvferry.connector.layout import KVLayout, LayoutError, PlaneMap, Region

PROTOCOL_VERSION = 4
MAGIC = b"KVF\x04"  # the last byte is PROTOCOL_VERSION, so a mismatched peer fails on the first byte check


class WireError(ValueError):
    """A message that cannot be decoded; the message names the bad field."""


@dataclass(frozen=True)
class PeerInfo:
    """What an engine rank's side channel serves: how to reach its NIXL agent and its KV layout."""

    TYPE: ClassVar[str] = "peer"
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    tp_rank: int
    tp_size: int
    incarnation: str  # changes on restart, so a cached peer with the same engine_id is reloaded
    layout: dict[str, Any]
    layout_fingerprint: str  # KVLayout.fingerprint of `layout`, checked when it is decoded


@dataclass(frozen=True)
class Registration:
    """Decode -> prefill: where to write the KV of (request_id, attempt)."""

    TYPE: ClassVar[str] = "reg"
    request_id: str
    attempt: int
    consumer_engine: str
    consumer_rank: int
    consumer_tp: int
    consumer_host: str  # side channel of this consumer rank, to fetch its PeerInfo once
    consumer_port: int
    incarnation: str
    num_tokens: int
    block_ids: list[list[int]]  # per KV group, the consumer's destination blocks
    revision: str = ""  # the consumer's revision; the producer acts only on its own
    layout_fingerprint: str = ""  # the consumer rank's layout these block ids address
    deadline_unix: float = 0.0  # the consumer's deadline (time.time()); no WRITE may start after it


@dataclass(frozen=True)
class Done:
    """Prefill -> decode, carried by the WRITE itself: this producer rank's part has landed."""

    TYPE: ClassVar[str] = "done"
    request_id: str
    attempt: int
    producer_engine: str
    producer_rank: int
    revision: str = ""  # the producer's revision; the consumer counts only notices of its own


@dataclass(frozen=True)
class Failure:
    """Prefill -> decode: this producer rank will not write (abort, lease expiry, handshake, write)."""

    TYPE: ClassVar[str] = "fail"
    request_id: str
    attempt: int
    producer_engine: str
    producer_rank: int
    reason: str
    revision: str = ""


@dataclass(frozen=True)
class Cancel:
    """Decode -> prefill: the consumer gave up (abort or deadline); do not start a write."""

    TYPE: ClassVar[str] = "cancel"
    request_id: str
    attempt: int
    consumer_engine: str
    consumer_rank: int
    revision: str = ""


Message = PeerInfo | Registration | Done | Failure | Cancel
_TYPES: dict[str, type] = {cls.TYPE: cls for cls in (PeerInfo, Registration, Done, Failure, Cancel)}


def encode(msg: Message) -> bytes:
    body = {"t": msg.TYPE, **dataclasses.asdict(msg)}
    return MAGIC + msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> Message:
    """Decode one message or raise WireError saying what is wrong with it."""
    if not isinstance(data, bytes | bytearray) or len(data) < len(MAGIC):
        raise WireError(f"message truncated: {len(data) if isinstance(data, bytes | bytearray) else 0} bytes")
    if data[:3] != MAGIC[:3]:
        raise WireError("not a kvferry message (bad magic)")
    if data[3] != PROTOCOL_VERSION:
        raise WireError(f"protocol version {data[3]} != ours {PROTOCOL_VERSION}")
    try:
        body = msgpack.unpackb(bytes(data[4:]), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for truncated/garbled input
        raise WireError(f"message body is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise WireError(f"message body is {type(body).__name__}, expected a map")
    cls = _TYPES.get(body.pop("t", None))
    if cls is None:
        raise WireError(f"unknown message type {body.get('t')!r}")
    return _build(cls, body)


def _build(cls: type, body: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    extra = sorted(set(body) - set(names))
    if extra:
        raise WireError(f"{cls.TYPE}: unexpected field {extra[0]!r}")
    for name in names:
        if name not in body:
            raise WireError(f"{cls.TYPE}: missing field {name!r}")
        _check(f"{cls.TYPE}.{name}", body[name], hints[name])
    return cls(**body)


def _check(where: str, value: Any, hint: Any) -> None:
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            _check(f"{where}[{i}]", item, typing.get_args(hint)[0])
        return
    expected = dict if origin is dict else hint
    ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
    if not ok:
        raise WireError(f"{where}: expected {expected.__name__}, got {type(value).__name__}")
    if expected is int and value < 0:
        raise WireError(f"{where}: must be >= 0, got {value}")
    if expected is float and not math.isfinite(value):
        raise WireError(f"{where}: must be finite, got {value}")


def layout_to_wire(layout: KVLayout) -> dict[str, Any]:
    return {
        **{n: getattr(layout, n) for n in _LAYOUT_SCALARS},
        "planes": [[p.offset, list(p.token_offsets), list(p.dim_offsets)] for p in layout.planes],
        "regions": [[r.base, r.num_blocks, r.group] for r in layout.regions],
    }


_LAYOUT_SCALARS = {
    "kind": str,
    "dtype": str,
    "block_size": int,
    "num_heads": int,
    "head_offset": int,
    "total_heads": int,
    "head_dim": int,
    "elem_bytes": int,
    "head_stride": int,
    "block_stride": int,
    "memory": str,
    "device_id": int,
}


def layout_from_wire(body: dict[str, Any], fingerprint: str | None = None) -> KVLayout:
    """Rebuild a peer's KVLayout; any problem (including a fingerprint that does not match what the
    layout hashes to) becomes a WireError naming the field."""
    for name, kind in {**_LAYOUT_SCALARS, "planes": list, "regions": list}.items():
        if name not in body:
            raise WireError(f"peer.layout: missing field {name!r}")
        if not isinstance(body[name], kind) or isinstance(body[name], bool):
            raise WireError(f"peer.layout.{name}: expected {kind.__name__}, got {type(body[name]).__name__}")
    try:
        planes = tuple(PlaneMap(int(o), tuple(map(int, t)), tuple(map(int, d))) for o, t, d in body["planes"])
        regions = tuple(Region(int(b), int(n), int(g)) for b, n, g in body["regions"])
        layout = KVLayout(**{n: body[n] for n in _LAYOUT_SCALARS}, planes=planes, regions=regions)
    except (LayoutError, TypeError, ValueError) as exc:
        raise WireError(f"peer.layout: {exc}") from None
    if fingerprint is not None and layout.fingerprint != fingerprint:
        raise WireError(
            f"peer.layout: fingerprint {fingerprint} does not match its layout ({layout.fingerprint})"
        )
    return layout
