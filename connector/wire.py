"""Wire step: the typed messages kvferry peers exchange, msgspec Structs encoded as msgpack.

Every message is `MAGIC + msgpack({"t": <type>, ...fields})`: a msgspec tagged union (tag field `t`,
written first). Decoding checks the magic and the protocol version, then msgspec checks the type and
every field's presence, type and bound (counts and ids are ints >= 0, never bools; no unknown
fields); floats must also be finite. Any problem raises `WireError` naming the bad field. Nothing is
read with a silent default: a field with a Python default (for callers) is still required on the wire.

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
     (Moving from msgpack + hand-written checks to msgspec kept every byte: still version 4.)
  5. Registration carries `first_token`: the consumer already holds the tokens before it (its own
     prefix-cache hit, whole consumer blocks) and its `block_ids` hold the tokens from it on; the
     producer writes only tokens [first_token, num_tokens).
  6. Sliding windows: PeerInfo.layout carries each KV group's window (`windows`, 0: full attention),
     in the fingerprint; a Registration's block id may be -1 (a block vLLM left as its null block,
     out of the window), never written. Done carries `sample`: a digest of a few tokens' KV as the
     producer sent them, which the consumer checks against its own blocks (sentinel.py); "" when the
     producer did not sample this one. Registration carries `tokens_digest` (of the consumer's first
     num_tokens prompt token ids) and `model_digest` (of its model, revision, dtype, quantization and
     tokenizer; connector/identity.py): the producer refuses a mismatch (`token_mismatch`,
     `model_mismatch`). Bounds: a message's numbers are capped (MAX_* below) and a PeerInfo is at
     most MAX_PEER_INFO bytes, so a hostile peer's layout is refused by name before anything is
     allocated for it.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Union

import msgspec
from kvferry.connector.layout import KVLayout, LayoutError, PlaneMap, Region
from kvferry.contracts import versions

# Defined once in contracts/versions.py: the operator's revision pins the same number.
PROTOCOL_VERSION = versions.WIRE_PROTOCOL_VERSION
MAGIC = b"KVF" + bytes([PROTOCOL_VERSION])  # a mismatched peer fails on the first byte check

Count = Annotated[int, msgspec.Meta(ge=0)]  # every count, rank and port on the wire
BlockId = Annotated[int, msgspec.Meta(ge=-1)]  # -1: no block (mapping.HOLE)

# Bounds of a peer's layout, each far above any model vLLM serves, checked before anything is built
# from it: the layout's offset tables are planes x heads x block_size x head_dim integers, so a
# PeerInfo claiming 10^4 heads would otherwise allocate gigabytes on the endpoint thread.
MAX_HEADS = 1024  # KV heads of a model (MHA models have 32 to 128)
MAX_BLOCK_SIZE = 8192  # tokens per kernel block (vLLM: 16 to a few hundred; hybrid models more)
MAX_HEAD_DIM = 4096  # elements per head (MLA's latent is 576)
MAX_PLANES = 2  # K and V (1 for a latent cache)
MAX_REGIONS = 8192  # layers x KV groups (one per layer, or one for a cross-layer layout)
MAX_GROUPS = 256  # KV cache groups (windows)
MAX_ELEM_BYTES = 16
MAX_BLOCK_ELEMENTS = 1 << 22  # planes x heads x block_size x head_dim of one rank's block (32 MiB of offsets)
MAX_NAME = 1024  # engine ids, agent names, incarnations, layout kinds and dtypes, fingerprints
MAX_AGENT_METADATA = 4 << 20  # NIXL agent metadata: ~50 bytes a region with UCX (measured), rkeys more
# The largest PeerInfo those bounds allow (msgpack: an int is at most 9 bytes, a string 5 + its
# length), so the side channel never reads more than a real peer can need.
MAX_PEER_INFO = (
    MAX_AGENT_METADATA
    + 9 * MAX_PLANES * (1 + MAX_BLOCK_SIZE + MAX_HEAD_DIM) + 27 * MAX_REGIONS + 9 * MAX_GROUPS
    + 32 * (5 + MAX_NAME) + 4096  # strings, field names and headers
)  # fmt: skip
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Int = Annotated[int, msgspec.Meta(ge=0)]  # addresses, offsets, strides


class WireError(ValueError):
    """A message that cannot be decoded; the message names the bad field."""


class _Message(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    """Every message: the type in field `t`, no unknown fields (mypy wants frozen=True on each subclass)."""


class PeerInfo(_Message, tag="peer", frozen=True):
    """What an engine rank's side channel serves: how to reach its NIXL agent and its KV layout."""

    engine_id: Name
    agent_name: Name
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA)]
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_HEADS)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEADS)]
    incarnation: Name  # changes on restart, so a cached peer with the same engine_id is reloaded
    layout: dict[str, Any]  # layout_to_wire(); checked by layout_from_wire
    layout_fingerprint: Name  # KVLayout.fingerprint of `layout`, checked when it is decoded


class Registration(_Message, tag="reg", frozen=True):
    """Decode -> prefill: where to write the KV of (request_id, attempt)."""

    request_id: str
    attempt: Count
    consumer_engine: str
    consumer_rank: Count
    consumer_tp: Count
    consumer_host: str  # side channel of this consumer rank, to fetch its PeerInfo once
    consumer_port: Count
    incarnation: str
    num_tokens: Count
    block_ids: list[list[BlockId]]  # per KV group, the consumer's destination blocks (-1: none)
    revision: str = ""  # the consumer's revision; the producer acts only on its own
    layout_fingerprint: str = ""  # the consumer rank's layout these block ids address
    deadline_unix: float = 0.0  # the consumer's deadline (time.time()); no WRITE may start after it
    first_token: Count = 0  # the consumer holds tokens before it; block_ids[g][0] holds this token
    tokens_digest: str = ""  # identity.tokens_digest of the consumer's first num_tokens prompt tokens
    model_digest: str = ""  # identity.model_digest of the consumer's weights and tokenizer


class Done(_Message, tag="done", frozen=True):
    """Prefill -> decode, carried by the WRITE itself: this producer rank's part has landed."""

    request_id: str
    attempt: Count
    producer_engine: str
    producer_rank: Count
    revision: str = ""  # the producer's revision; the consumer counts only notices of its own
    sample: str = ""  # sentinel.py: digest of the sampled tokens' KV as sent ("" when not sampled)


class Failure(_Message, tag="fail", frozen=True):
    """Prefill -> decode: this producer rank will not write (abort, lease expiry, handshake, write)."""

    request_id: str
    attempt: Count
    producer_engine: str
    producer_rank: Count
    reason: str
    revision: str = ""


class Cancel(_Message, tag="cancel", frozen=True):
    """Decode -> prefill: the consumer gave up (abort or deadline); do not start a write."""

    request_id: str
    attempt: Count
    consumer_engine: str
    consumer_rank: Count
    revision: str = ""


Message = PeerInfo | Registration | Done | Failure | Cancel
_CLASSES = (PeerInfo, Registration, Done, Failure, Cancel)
_TYPES = frozenset(cls.__struct_config__.tag for cls in _CLASSES)


def _all_required(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """`cls` without defaults, for decoding: a peer of our version sends every field."""
    fields = [(f.name, f.type) for f in msgspec.structs.fields(cls)]
    tag = cls.__struct_config__.tag
    return msgspec.defstruct(f"{cls.__name__}OnWire", fields, bases=(_Message,), tag=tag, module=__name__)


_ON_WIRE = {_all_required(cls): cls for cls in _CLASSES}
_FLOATS = {cls: [f.name for f in msgspec.structs.fields(cls) if f.type is float] for cls in _CLASSES}
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Union[tuple(_ON_WIRE)])  # noqa: UP007 (a runtime union of classes)
_LAYOUT_PREFIX = "peer.layout"


def encode(msg: Message) -> bytes:
    return MAGIC + _ENCODER.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one message or raise WireError saying what is wrong with it."""
    if not isinstance(data, bytes | bytearray) or len(data) < len(MAGIC):
        raise WireError(f"message truncated: {len(data) if isinstance(data, bytes | bytearray) else 0} bytes")
    if data[:3] != MAGIC[:3]:
        raise WireError("not a kvferry message (bad magic)")
    if data[3] != PROTOCOL_VERSION:
        raise WireError(f"protocol version {data[3]} != ours {PROTOCOL_VERSION}")
    body = memoryview(data)[4:]
    try:
        on_wire = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, body) from None
    except msgspec.DecodeError as exc:  # truncated or garbled
        raise WireError(f"message body is not valid msgpack ({exc})") from None
    cls = _ON_WIRE[type(on_wire)]
    for name in _FLOATS[cls]:
        value = getattr(on_wire, name)
        if not math.isfinite(value):
            raise WireError(f"{cls.__struct_config__.tag}.{name}: must be finite, got {value}")
    return cls(*msgspec.structs.astuple(on_wire))


# msgspec says `Expected `int` >= 0 - at `$.block_ids[0][1]``; we say `reg.block_ids[0][1]: must be >= 0`.
_AT = re.compile(r"(?P<what>.*?)(?: - at `\$(?P<path>.*)`)?", re.DOTALL)
_FIELD = re.compile(r"Object (?P<kind>missing required|contains unknown) field `(?P<name>.*)`")
_TYPE = re.compile(r"Expected `(?P<want>\w+)`, got `(?P<got>\w+)`")
_BOUND = re.compile(r"Expected `\w+` (?P<bound>.+)")
_WANT = {"array": "a list", "object": "a map"}
_GOT = {"array": "list", "object": "map", "null": "nil"}


def _invalid(exc: msgspec.ValidationError, body: memoryview) -> WireError:
    """Name what is wrong with a body that is not one of our messages (the error path only)."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError as err:  # msgspec stops at the first wrong type, before reading it all
        return WireError(f"message body is not valid msgpack ({err})")
    if not isinstance(raw, dict):
        return WireError(f"message body is {type(raw).__name__}, expected a map")
    claimed = raw.get("t")
    if not (isinstance(claimed, str) and claimed in _TYPES):
        return WireError(f"unknown message type {claimed!r}")
    return _named(exc, claimed)


def _named(exc: msgspec.ValidationError, root: str) -> WireError:
    match = _AT.fullmatch(str(exc))
    assert match is not None  # the pattern matches any text
    what, where = match["what"], root + (match["path"] or "")
    if m := _FIELD.fullmatch(what):
        kind = "missing" if m["kind"] == "missing required" else "unexpected"
        return WireError(f"{where}: {kind} field {m['name']!r}")
    if m := _TYPE.fullmatch(what):
        return WireError(
            f"{where}: expected {_WANT.get(m['want'], m['want'])}, got {_GOT.get(m['got'], m['got'])}"
        )
    if m := _BOUND.fullmatch(what):
        return WireError(f"{where}: must be {m['bound']}")
    return WireError(f"{where}: {what}")


# The layout's numbers (Meta bounds name the field and bound in the error)
# (upper bounds only where KVLayout refuses a value below 1 by name before it allocates anything)
Heads = Annotated[int, msgspec.Meta(le=MAX_HEADS)]
HeadIndex = Annotated[int, msgspec.Meta(ge=0, le=MAX_HEADS)]
BlockSize = Annotated[int, msgspec.Meta(le=MAX_BLOCK_SIZE)]
HeadDim = Annotated[int, msgspec.Meta(le=MAX_HEAD_DIM)]
ElemBytes = Annotated[int, msgspec.Meta(le=MAX_ELEM_BYTES)]
Group = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]
TokenTable = Annotated[list[Int], msgspec.Meta(max_length=MAX_BLOCK_SIZE)]
DimTable = Annotated[list[Int], msgspec.Meta(max_length=MAX_HEAD_DIM)]


class _Layout(msgspec.Struct):
    """KVLayout as layout_to_wire writes it, every number bounded (MAX_*); unknown keys are ignored
    (the fingerprint covers meaning)."""

    kind: Name
    dtype: Name
    block_size: BlockSize
    num_heads: Heads
    head_offset: HeadIndex
    total_heads: Heads
    head_dim: HeadDim
    elem_bytes: ElemBytes
    head_stride: Int
    block_stride: Int
    memory: Name
    device_id: HeadIndex
    # [offset, token offsets, dim offsets]
    planes: Annotated[list[tuple[Int, TokenTable, DimTable]], msgspec.Meta(max_length=MAX_PLANES)]
    # [base, num_blocks, group]
    regions: Annotated[list[tuple[Int, Int, Group]], msgspec.Meta(max_length=MAX_REGIONS)]
    windows: Annotated[list[Int], msgspec.Meta(max_length=MAX_GROUPS)]  # per KV group (0: full attention)


_LAYOUT_SCALARS = [name for name in _Layout.__struct_fields__ if name not in ("planes", "regions", "windows")]


def layout_to_wire(layout: KVLayout) -> dict[str, Any]:
    return {
        **{n: getattr(layout, n) for n in _LAYOUT_SCALARS},
        "planes": [[p.offset, list(p.token_offsets), list(p.dim_offsets)] for p in layout.planes],
        "regions": [[r.base, r.num_blocks, r.group] for r in layout.regions],
        "windows": list(layout.windows),
    }


def layout_from_wire(body: dict[str, Any], fingerprint: str | None = None) -> KVLayout:
    """Rebuild a peer's KVLayout; any problem (including a fingerprint that does not match what the
    layout hashes to) becomes a WireError naming the field."""
    try:
        wire = msgspec.convert(body, _Layout)
    except msgspec.ValidationError as exc:
        raise _named(exc, _LAYOUT_PREFIX) from None
    elements = len(wire.planes) * max(wire.num_heads, 0) * max(wire.block_size, 0) * max(wire.head_dim, 0)
    if elements > MAX_BLOCK_ELEMENTS:  # before KVLayout builds (and sorts) that many offsets
        raise WireError(
            f"{_LAYOUT_PREFIX}: {len(wire.planes)} planes x {wire.num_heads} heads x {wire.block_size} "
            f"tokens x {wire.head_dim} dims = {elements} elements a block, more than {MAX_BLOCK_ELEMENTS}"
        )
    try:
        layout = KVLayout(
            **{n: getattr(wire, n) for n in _LAYOUT_SCALARS},
            planes=tuple(PlaneMap(o, tuple(t), tuple(d)) for o, t, d in wire.planes),
            regions=tuple(Region(b, n, g) for b, n, g in wire.regions),
            windows=tuple(wire.windows),
        )
    except (LayoutError, TypeError, ValueError) as exc:
        raise WireError(f"{_LAYOUT_PREFIX}: {exc}") from None
    if fingerprint is not None and layout.fingerprint != fingerprint:
        raise WireError(
            f"{_LAYOUT_PREFIX}: fingerprint {fingerprint} does not match its layout ({layout.fingerprint})"
        )
    return layout
