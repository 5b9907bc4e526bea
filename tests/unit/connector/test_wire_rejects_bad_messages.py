"""wire: round trips, the bytes of protocol 6, and every malformed or truncated message names what is
wrong."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvferry.connector.wire import (
    MAGIC,
    Done,
    Failure,
    PeerInfo,
    Registration,
    WireError,
    decode,
    encode,
    layout_from_wire,
    layout_to_wire,
)
from kvferry.tools.hostkv import synthetic_layout

REG = Registration("req-1", 2, "decode-0", 1, 2, "127.0.0.1", 5601, "abc", 300, [[4, 5, 6]])


def raw(body: object) -> bytes:
    return MAGIC + msgspec.msgpack.encode(body)


def test_round_trip():
    for msg in (REG, Done("r", 0, "p", 0), Failure("r", 1, "p", 3, "lease_expired")):
        assert decode(encode(msg)) == msg


# Protocol 6 on the wire, written out by hand from protocol 5's bytes: the version byte 05 -> 06; in
# Done one more map entry (86 -> 87) `sample` = "" (a6 "sample" a0) after `revision`; in the
# registration two more (fixmap 8f -> map16 de0011) after `first_token`: `tokens_digest` = "" and
# `model_digest` = "". A registration's block ids may be -1 and a layout carries `windows`, neither of
# which these messages use.
V6_BYTES = [
    (
        Registration(
            "req-1",
            2,
            "decode-0",
            1,
            2,
            "127.0.0.1",
            5601,
            "abc",
            300,
            [[4, 5, 6]],
            "r1",
            "fp",
            1.7e9 + 0.5,
            64,
        ),
        "4b564606de0011a174a3726567aa726571756573745f6964a57265712d31a7617474656d707402af636f6e73756d65725f65"
        "6e67696e65a86465636f64652d30ad636f6e73756d65725f72616e6b01ab636f6e73756d65725f747002ad636f6e73756d65"
        "725f686f7374a93132372e302e302e31ad636f6e73756d65725f706f7274cd15e1ab696e6361726e6174696f6ea3616263aa"
        "6e756d5f746f6b656e73cd012ca9626c6f636b5f6964739193040506a87265766973696f6ea27231b26c61796f75745f6669"
        "6e6765727072696e74a26670ad646561646c696e655f756e6978cb41d954fc40200000ab66697273745f746f6b656e40ad74"
        "6f6b656e735f646967657374a0ac6d6f64656c5f646967657374a0",
    ),
    (
        Done("r", 0, "p", 0),
        "4b56460687a174a4646f6e65aa726571756573745f6964a172a7617474656d707400af70726f64756365725f656e67696e65"
        "a170ad70726f64756365725f72616e6b00a87265766973696f6ea0a673616d706c65a0",
    ),
    (
        PeerInfo("e", "a", b"\x00\x01", 0, 1, "i", {"k": [1, 2]}, "fp"),
        "4b56460689a174a470656572a9656e67696e655f6964a165aa6167656e745f6e616d65a161ae6167656e745f6d6574616461"
        "7461c4020001a774705f72616e6b00a774705f73697a6501ab696e6361726e6174696f6ea169a66c61796f757481a16b9201"
        "02b26c61796f75745f66696e6765727072696e74a26670",
    ),
]
# Protocol 4's registration (no first_token): a peer of the old protocol is refused on its version byte.
V4_REGISTRATION = (
    "4b5646048ea174a3726567aa726571756573745f6964a57265712d31a7617474656d707402af636f6e73756d65725f656e67"
    "696e65a86465636f64652d30ad636f6e73756d65725f72616e6b01ab636f6e73756d65725f747002ad636f6e73756d6572"
    "5f686f7374a93132372e302e302e31ad636f6e73756d65725f706f7274cd15e1ab696e6361726e6174696f6ea3616263aa"
    "6e756d5f746f6b656e73cd012ca9626c6f636b5f6964739193040506a87265766973696f6ea27231b26c61796f75745f66"
    "696e6765727072696e74a26670ad646561646c696e655f756e6978cb41d954fc40200000"
)


@pytest.mark.parametrize(("msg", "hexed"), V6_BYTES, ids=["reg", "done", "peer"])
def test_protocol_6_bytes(msg, hexed):
    assert encode(msg).hex() == hexed
    assert decode(bytes.fromhex(hexed)) == msg


# Protocol 5's Done (no `sample`): a peer of the protocol before sliding windows is refused by version.
V5_DONE = (
    "4b56460586a174a4646f6e65aa726571756573745f6964a172a7617474656d707400af70726f64756365725f656e67696e"
    "65a170ad70726f64756365725f72616e6b00a87265766973696f6ea0"
)


def test_protocol_5_peers_are_refused_by_version():
    with pytest.raises(WireError, match="protocol version 5 != ours 6"):
        decode(bytes.fromhex(V5_DONE))


def test_protocol_4_peers_are_refused_by_version():
    with pytest.raises(WireError, match="protocol version 4 != ours 6"):
        decode(bytes.fromhex(V4_REGISTRATION))


def test_a_registration_without_first_token_is_refused():
    body = msgspec.msgpack.decode(bytes.fromhex(V6_BYTES[0][1])[4:])
    del body["first_token"]
    with pytest.raises(WireError, match="reg: missing field 'first_token'"):
        decode(raw(body))


@given(st.integers(min_value=0, max_value=200))
def test_every_truncation_is_a_wire_error(cut):
    data = encode(REG)
    if cut < len(data):
        with pytest.raises(WireError):
            decode(data[:cut])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.pop("attempt"), "reg: missing field 'attempt'"),
        (lambda b: b.update(attempt="0"), "reg.attempt: expected int, got str"),
        (lambda b: b.update(attempt=True), "reg.attempt: expected int, got bool"),
        (lambda b: b.update(attempt=-1), "reg.attempt: must be >= 0"),
        (lambda b: b.update(block_ids=[[1, "x"]]), r"reg.block_ids\[0\]\[1\]: expected int"),
        (lambda b: b.update(block_ids=5), "reg.block_ids: expected a list"),
        (lambda b: b.update(surprise=1), "unexpected field 'surprise'"),
        (lambda b: b.update(t="nope"), "unknown message type 'nope'"),
        (lambda b: b.update(t=[1]), r"unknown message type \[1\]"),
        (lambda b: b.pop("t"), "unknown message type None"),
        # a default is for callers only: a peer of this version sends every field
        (lambda b: b.pop("revision"), "reg: missing field 'revision'"),
        (lambda b: b.pop("deadline_unix"), "reg: missing field 'deadline_unix'"),
        (lambda b: b.update(deadline_unix="soon"), "reg.deadline_unix: expected float, got str"),
        (lambda b: b.update(request_id=b"x"), "reg.request_id: expected str, got bytes"),
        (lambda b: b.update(consumer_port=5601.0), "reg.consumer_port: expected int, got float"),
    ],
)
def test_malformed_registration_names_the_field(mutate, message):
    body = msgspec.msgpack.decode(encode(REG)[4:])
    mutate(body)
    with pytest.raises(WireError, match=message):
        decode(raw(body))


def test_foreign_bytes_and_versions_are_rejected():
    with pytest.raises(WireError, match="bad magic"):
        decode(b"PUSH_REG:" + b"x" * 10)
    with pytest.raises(WireError, match="protocol version 9"):
        decode(b"KVF\x09" + encode(REG)[4:])
    with pytest.raises(WireError, match="expected a map"):
        decode(raw([1, 2]))
    with pytest.raises(WireError, match="not valid msgpack"):
        decode(MAGIC + b"garbage")
    with pytest.raises(WireError, match="not valid msgpack"):
        decode(encode(REG) + b"\x00")  # trailing bytes


def test_peer_metadata_must_be_bytes_and_layout_a_map():
    body = msgspec.msgpack.decode(encode(V6_BYTES[2][0])[4:])
    with pytest.raises(WireError, match="peer.agent_metadata: expected bytes, got str"):
        decode(raw({**body, "agent_metadata": "x"}))
    with pytest.raises(WireError, match="peer.layout: expected a map, got list"):
        decode(raw({**body, "layout": []}))


def test_layout_round_trip_and_bad_layout():
    layout = synthetic_layout(
        "head_major",
        bases=[4096, 1 << 20],
        num_blocks=8,
        block_size=16,
        num_heads=2,
        head_dim=8,
        elem_bytes=4,
    )
    assert layout_from_wire(layout_to_wire(layout)) == layout
    body = layout_to_wire(layout)
    body["block_size"] = 0
    with pytest.raises(WireError, match="block_size must be positive"):
        layout_from_wire(body)
    del body["regions"]
    with pytest.raises(WireError, match="missing field 'regions'"):
        layout_from_wire(body)


def test_layout_whose_fingerprint_does_not_match_is_rejected():
    layout = synthetic_layout(
        "k_transposed",
        bases=[4096],
        num_blocks=8,
        block_size=16,
        num_heads=2,
        head_dim=8,
        elem_bytes=2,
        dtype="bfloat16",
    )
    body = layout_to_wire(layout)
    assert layout_from_wire(body, layout.fingerprint).planes == layout.planes
    body["head_stride"] *= 2  # heads moved apart: another layout than the one fingerprinted
    body["block_stride"] *= 2
    with pytest.raises(WireError, match="fingerprint"):
        layout_from_wire(body, layout.fingerprint)
    body = layout_to_wire(layout)
    body["planes"] = [[0, [0], [0]]]
    with pytest.raises(WireError, match="token and 1 dim offsets"):
        layout_from_wire(body)
    body["planes"] = [[0, [0], ["1"]]]
    with pytest.raises(WireError, match=r"peer.layout.planes\[0\]\[2\]\[0\]: expected int, got str"):
        layout_from_wire(body)
    body["planes"] = [[0, [0]]]
    with pytest.raises(WireError, match=r"peer.layout.planes\[0\]: "):
        layout_from_wire(body)
