"""params: the router's kvferry block (docs/contracts.md §1) parses, and each defect is named."""

from __future__ import annotations

import pytest
from kvferry.connector.params import ConsumerParams, ParamsError, ProducerParams, parse, wants_transfer

from tests.unit.docedit import mutated

PREFILL = {
    "do_remote_decode": True,
    "kvferry": {
        "v": 1,
        "request_id": "abc",
        "attempt": 0,
        "role": "producer",
        "consumer": {"engine_id": "decode-0"},
        "deadline_s": 30.0,
    },
}
DECODE = {
    "do_remote_prefill": True,
    "kvferry": {
        "v": 1,
        "request_id": "abc",
        "attempt": 2,
        "role": "consumer",
        "producer": {"engine_id": "prefill-0", "host": "127.0.0.1", "port": 5600, "tp_size": 1},
    },
}


def test_contract_examples_parse():
    assert parse(PREFILL, "producer", 9.0) == ProducerParams("abc", 0, "decode-0", 30.0)
    assert parse(DECODE, "consumer", 9.0) == ConsumerParams("abc", 2, "prefill-0", "127.0.0.1", 5600, 1, 9.0)
    assert wants_transfer(PREFILL) == "producer" and wants_transfer(DECODE) == "consumer"
    assert wants_transfer({}) is None and wants_transfer(None) is None


@pytest.mark.parametrize(
    ("params", "role", "message"),
    [
        ({"do_remote_prefill": True}, "consumer", "kvferry is missing"),
        (mutated(DECODE, ["kvferry", "v"], 2), "consumer", "kvferry.v=2"),
        (mutated(DECODE, ["kvferry", "attempt"], KeyError), "consumer", "kvferry.attempt is missing"),
        (mutated(DECODE, ["kvferry", "attempt"], "1"), "consumer", "attempt must be a non-negative integer"),
        (mutated(DECODE, ["kvferry", "producer", "port"], 0), "consumer", "port=0 is not a TCP port"),
        (mutated(DECODE, ["kvferry", "producer", "tp_size"], 0), "consumer", "tp_size must be >= 1"),
        (mutated(DECODE, ["kvferry", "producer"], "p"), "consumer", "producer must be an object"),
        (
            mutated(DECODE, ["kvferry", "producer", "host"], ""),
            "consumer",
            "producer.host must be a non-empty",
        ),
        (mutated(DECODE, ["kvferry", "deadline_s"], -1), "consumer", "deadline_s must be a positive number"),
        (mutated(DECODE, ["kvferry", "deadline_s"], 1e9), "consumer", "deadline_s must be .* up to 3600"),
        (mutated(DECODE, ["kvferry", "deadline_s"], float("inf")), "consumer", "deadline_s must be"),
        (mutated(PREFILL, ["kvferry", "deadline_s"], float("nan")), "producer", "deadline_s must be"),
        (
            mutated(PREFILL, ["kvferry", "consumer", "engine_id"], KeyError),
            "producer",
            "consumer.engine_id is",
        ),
        (PREFILL, "consumer", "role='producer' sent to a consumer"),
    ],
)
def test_each_defect_is_named(params, role, message):
    with pytest.raises(ParamsError, match=message):
        parse(params, role, 30.0)
