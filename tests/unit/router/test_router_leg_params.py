"""Leg params: kvferry params are the contract types; upstream push always carries remote_request_id."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kvferry.contracts.params import ConsumerParams, ProducerParams
from kvferry.router import params as legs
from kvferry.router.aggregate import streaming_body
from kvferry.router.config import Endpoint
from kvferry.router.errors import ApiError

P = Endpoint("prefill", "http://127.0.0.1:8100", "prefill-0", "127.0.0.1", 5600, 1, "r1")
D = Endpoint("decode", "http://127.0.0.1:8200", "decode-0", "127.0.0.1", 5601, 1, "r1")


def test_kvferry_params_are_the_contract_types() -> None:
    # The wire shape itself is pinned against docs/contracts.md in tests/unit/contracts.
    assert (
        legs.prefill_params("kvferry", "rid", 2, D, 30.0)
        == ProducerParams("rid", 2, "decode-0", 30.0).kv_transfer_params()
    )
    assert (
        legs.decode_params("kvferry", legs.COMPLETIONS, "rid", 2, P, 30.0)
        == ConsumerParams("rid", 2, "prefill-0", "127.0.0.1", 5600, 1, 30.0).kv_transfer_params()
    )


@pytest.mark.parametrize(("path", "rid"), [(legs.COMPLETIONS, "cmpl-abc-0"), (legs.CHAT, "chatcmpl-abc")])
def test_upstream_push_decode_params_always_have_remote_request_id(path: str, rid: str) -> None:
    params = legs.decode_params("vllm-push", path, "abc", 0, P, 30.0)
    required = {"do_remote_prefill", "remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size"}
    assert required <= set(params)
    assert params["remote_request_id"] == rid
    assert (params["remote_engine_id"], params["remote_port"]) == ("prefill-0", 5600)


def test_pull_forwards_prefill_params_verbatim_and_refuses_none() -> None:
    answer = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "prefill-0"}
    assert legs.decode_params("vllm-pull", legs.COMPLETIONS, "r", 0, P, 0, answer) == answer
    with pytest.raises(ValueError, match="forwards the prefill response"):
        legs.decode_params("vllm-pull", legs.COMPLETIONS, "r", 0, P, 0, None)


def test_prefill_body_is_one_token_non_streaming() -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"a": 1},
            "min_tokens": 3, "max_completion_tokens": 50}  # fmt: skip
    out = legs.prefill_body(body, {"do_remote_decode": True})
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 50, "the client body is not modified"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (legs.COMPLETIONS, [], 400, None),
        (legs.COMPLETIONS, {"prompt": ""}, 400, "prompt"),
        (legs.COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt"),
        (legs.COMPLETIONS, {"prompt": "a", "n": 2}, 400, "n"),
        (legs.COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        (legs.COMPLETIONS, {"prompt": "a", "stream": "yes"}, 400, "stream"),
        (legs.COMPLETIONS, {"prompt": "a", "kv_transfer_params": {}}, 400, "kv_transfer_params"),
        (legs.COMPLETIONS, {"prompt": "a", "model": "other"}, 404, "model"),
        (legs.CHAT, {"messages": []}, 400, "messages"),
    ],
)
def test_bad_requests_are_rejected_with_the_field(
    path: str, body: Any, status: int, param: str | None
) -> None:
    with pytest.raises(ApiError) as err:
        legs.validate(path, body, "tiny")
    assert err.value.status == status and err.value.param == param
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_good_requests_pass() -> None:
    assert legs.validate(legs.COMPLETIONS, {"prompt": [1, 2, 3], "stream": True}, "tiny").stream is True
    assert legs.validate(legs.COMPLETIONS, {"prompt": ["one"], "model": "tiny"}, "tiny").stream is False
    assert legs.validate(legs.CHAT, {"messages": [{"role": "user", "content": "hi"}]}, None).path == legs.CHAT


def test_leg_bodies_leave_the_client_body_as_it_came() -> None:
    """Leg bodies are shallow copies (no per-leg deep copy of a long prompt): building every leg the
    router can send changes nothing in the client's body, nested values included, and each leg has the
    shape its engine needs."""
    body: dict[str, Any] = {
        "model": "tiny", "prompt": list(range(2048)), "max_tokens": 32, "stream": False,
        "stream_options": {"include_usage": False}, "logprobs": 2, "n": 1,
    }  # fmt: skip
    before = copy.deepcopy(body)
    p_body = legs.prefill_body(body, legs.prefill_params("kvferry", "rid", 0, D, 30.0))
    d_body = legs.decode_body(body, legs.decode_params("kvferry", legs.COMPLETIONS, "rid", 0, P, 30.0))
    s_body = streaming_body(d_body)
    assert body == before
    assert (p_body["max_tokens"], p_body["stream"], "stream_options" in p_body, "logprobs" in p_body) == (
        1, False, False, False,
    )  # fmt: skip
    assert s_body["stream"] is True and s_body["stream_options"] == {"include_usage": True}
    assert d_body["stream_options"] == {"include_usage": False}  # the streamed copy got its own options
    assert "kv_transfer_params" in d_body and "kv_transfer_params" not in body
    assert p_body["prompt"] == d_body["prompt"] == before["prompt"]
