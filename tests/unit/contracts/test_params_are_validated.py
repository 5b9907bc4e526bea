"""params: the kvferry block of docs/contracts.md §1 parses as written there, and each defect is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kvferry.contracts.params import (
    ConsumerParams,
    ParamsError,
    ProducerParams,
    parse,
    wants_transfer,
)

from tests.unit.docedit import mutated

CONTRACTS = Path(__file__).resolve().parents[3] / "docs" / "contracts.md"
PREFILL = ProducerParams("abc", 0, "decode-0", 30.0).kv_transfer_params()
DECODE = ConsumerParams("abc", 2, "prefill-0", "127.0.0.1", 5600, 1, 30.0).kv_transfer_params()


def doc_examples() -> list[dict]:
    """The JSON examples of §1, the prose a person reads."""
    section = CONTRACTS.read_text().split("## 1.", 1)[1].split("\n## ", 1)[0]
    return [
        json.loads(block)["kv_transfer_params"] for block in re.findall(r"```json\n(.*?)```", section, re.S)
    ]


def test_the_documented_examples_are_what_the_types_write() -> None:
    prefill, decode = doc_examples()
    p, d = parse(prefill, "producer", 9.0), parse(decode, "consumer", 9.0)
    assert p.kv_transfer_params() == prefill and d.kv_transfer_params() == decode
    assert p == ProducerParams("<router id>", 0, "<D engine id>", 30.0)
    assert d == ConsumerParams("<router id>", 0, "<P engine id>", "<P side-channel host>", 5600, 1, 30.0)


def test_roles_and_the_default_deadline() -> None:
    no_deadline = mutated(DECODE, ["kvferry", "deadline_s"], KeyError)
    assert parse(no_deadline, "consumer", 9.0) == ConsumerParams(
        "abc", 2, "prefill-0", "127.0.0.1", 5600, 1, 9.0
    )
    assert wants_transfer(PREFILL) == "producer" and wants_transfer(DECODE) == "consumer"
    assert wants_transfer({}) is None and wants_transfer(None) is None


@pytest.mark.parametrize(
    ("params", "role", "message"),
    [
        ({"do_remote_prefill": True}, "consumer", "kvferry is missing"),
        (mutated(DECODE, ["kvferry", "v"], 2), "consumer", "kvferry.v=2"),
        (mutated(DECODE, ["kvferry", "v"], True), "consumer", "kvferry.v=True"),
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
        (mutated(PREFILL, ["kvferry", "request_id"], 7), "producer", "request_id must be a non-empty string"),
        (PREFILL, "consumer", "role='producer' sent to a consumer"),
    ],
)
def test_each_defect_is_named(params, role, message) -> None:
    with pytest.raises(ParamsError, match=message):
        parse(params, role, 30.0)


def test_the_writer_cannot_build_what_the_reader_refuses() -> None:
    with pytest.raises(ParamsError, match="deadline_s must be .* up to 3600"):
        ProducerParams("abc", 0, "decode-0", 5000.0)
    with pytest.raises(ParamsError, match="producer.port=70000 is not a TCP port"):
        ConsumerParams("abc", 0, "prefill-0", "10.0.0.1", 70000, 1, 30.0)
