"""Round trip: every kvferry leg the router builds, sent as JSON, parses on the connector side with the
same values (request id, attempt, peer identity, deadline), and on the role it was built for only."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvferry.contracts.params import MAX_DEADLINE_S, ConsumerParams, ParamsError, ProducerParams, parse
from kvferry.router import params as legs
from kvferry.router.config import Endpoint

names = st.text(min_size=1, max_size=40)
deadlines = st.floats(min_value=0, max_value=MAX_DEADLINE_S, exclude_min=True, allow_nan=False)


@st.composite
def endpoints(draw: st.DrawFn, role: str) -> Endpoint:
    return Endpoint(
        role=role,
        url="http://127.0.0.1:8000",
        engine_id=draw(names),
        side_host=draw(st.one_of(st.ip_addresses().map(str), names)),
        side_port=draw(st.integers(1, 65535)),
        tp_size=draw(st.integers(1, 64)),
        revision="r1",
    )


def over_http(params: dict) -> dict:
    """What vLLM's API server hands the connector: the leg body's params after JSON."""
    return json.loads(json.dumps(params))


@given(
    rid=names,
    attempt=st.integers(0, 2**31),
    prefill=endpoints("prefill"),
    decode=endpoints("decode"),
    transfer_s=deadlines,
    path=st.sampled_from([legs.COMPLETIONS, legs.CHAT]),
)
def test_router_legs_parse_value_by_value(
    rid: str, attempt: int, prefill: Endpoint, decode: Endpoint, transfer_s: float, path: str
) -> None:
    p_leg = over_http(legs.prefill_params("kvferry", rid, attempt, decode, transfer_s))
    d_leg = over_http(legs.decode_params("kvferry", path, rid, attempt, prefill, transfer_s))

    p = parse(p_leg, "producer", default_deadline_s=1.0)
    assert (p.request_id, p.attempt, p.consumer_engine, p.deadline_s) == (
        rid, attempt, decode.engine_id, transfer_s
    )  # fmt: skip
    d = parse(d_leg, "consumer", default_deadline_s=1.0)
    assert (d.request_id, d.attempt, d.deadline_s) == (rid, attempt, transfer_s)
    assert (d.producer_engine, d.producer_host, d.producer_port, d.producer_tp) == (
        prefill.engine_id, prefill.side_host, prefill.side_port, prefill.tp_size
    )  # fmt: skip
    # Both legs name the same transfer key, the one the producer and consumer rendezvous on.
    assert (p.request_id, p.attempt) == (d.request_id, d.attempt)
    with pytest.raises(ParamsError, match="sent to a consumer"):
        parse(p_leg, "consumer", 1.0)
    with pytest.raises(ParamsError, match="sent to a producer"):
        parse(d_leg, "producer", 1.0)


@given(
    st.builds(ProducerParams, names, st.integers(0, 2**31), names, deadlines)
    | st.builds(
        ConsumerParams,
        names,
        st.integers(0, 2**31),
        names,
        names,
        st.integers(1, 65535),
        st.integers(1, 64),
        deadlines,
    )  # fmt: skip
)
def test_parse_inverts_to_dict(value: ProducerParams | ConsumerParams) -> None:
    assert parse(over_http(value.kv_transfer_params()), value.role, 1.0) == value
