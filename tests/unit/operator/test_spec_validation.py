"""Offline validation (spec.parse_spec) rejects the same CRs the API server does, naming the field."""

from __future__ import annotations

import pytest
from kvferry.operator.spec import SpecError, parse_spec

from tests.unit.operator.cases import INVALID, VALID


@pytest.mark.parametrize(("case", "cr", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_rejected_naming_the_field(case: str, cr: dict, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(cr["spec"], cr["metadata"]["name"])
    assert any(err.startswith(field) for err in info.value.errors), info.value.errors


@pytest.mark.parametrize("case", sorted(VALID))
def test_valid_spec_parses(case: str) -> None:
    cr = VALID[case]
    assert parse_spec(cr["spec"], cr["metadata"]["name"]).model == "/models/tiny"


def test_defaults_match_the_documented_ones() -> None:
    spec = parse_spec({"model": "m"})
    assert (spec.accelerator, spec.kv_transfer.mode, spec.kv_transfer.connector) == ("cpu", "push", "kvferry")
    assert (spec.prefill.replicas, spec.decode.tensor_parallel_size, spec.vllm.block_size) == (1, 1, None)


def test_an_unset_block_size_is_the_presets() -> None:
    from kvferry.operator.render.presets import block_size

    assert block_size(parse_spec({"model": "m"})) == 128  # cpu: vLLM-CPU needs a multiple of 32
    assert block_size(parse_spec({"model": "m", "accelerator": "p5en"})) == 16
    assert block_size(parse_spec({"model": "m", "accelerator": "p5en", "vllm": {"blockSize": 64}})) == 64


def test_unknown_and_mistyped_fields_are_all_reported() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"model": "m", "decode": {"replicas": "two", "tp": 2}, "router": []})
    errors = "\n".join(info.value.errors)
    assert "spec.decode.replicas: expected int" in errors
    assert "spec.decode.tp: unknown field" in errors
    assert "spec.router: expected a mapping" in errors
