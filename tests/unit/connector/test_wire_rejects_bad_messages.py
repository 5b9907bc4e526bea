"""wire: round trips, and every malformed or truncated message names what is wrong."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvferry.connector.wire import (
    MAGIC,
    Done,
    Failure,
    Registration,
    WireError,
    decode,
    encode,
    layout_from_wire,
    layout_to_wire,
)
from kvferry.tools.hostkv import synthetic_layout

REG = Registration("req-1", 2, "decode-0", 1, 2, "127.0.0.1", 5601, "abc", 300, [[4, 5, 6]])


def raw(body: dict) -> bytes:
    return MAGIC + msgpack.packb(body, use_bin_type=True)


def test_round_trip():
    for msg in (REG, Done("r", 0, "p", 0), Failure("r", 1, "p", 3, "lease_expired")):
        assert decode(encode(msg)) == msg


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
        (lambda b: b.update(t="nope"), "unknown message type"),
    ],
)
def test_malformed_registration_names_the_field(mutate, message):
    body = msgpack.unpackb(encode(REG)[4:])
    mutate(body)
    with pytest.raises(WireError, match=message):
        decode(raw(body))


def test_foreign_bytes_and_versions_are_rejected():
    with pytest.raises(WireError, match="bad magic"):
        decode(b"PUSH_REG:" + b"x" * 10)
    with pytest.raises(WireError, match="protocol version 9"):
        decode(b"KVF\x09" + encode(REG)[4:])
    with pytest.raises(WireError, match="expected a map"):
        decode(MAGIC + msgpack.packb([1, 2]))


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
