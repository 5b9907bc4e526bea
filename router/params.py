"""Leg-building step: validate a client request and build the prefill and decode leg bodies per mode.

Pure functions (no I/O). The kvferry block is built with kvferry.contracts.params, the types the
connector parses (docs/contracts.md §1); the upstream params follow vllm-push-connector.md §2.4.
Upstream push kills the whole decode engine when `remote_request_id` is missing, so `decode_params`
always sets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry.contracts.params import ConsumerParams, ProducerParams
from kvferry.router.config import Endpoint
from kvferry.router.errors import ApiError, bad_request

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Fields that make no sense on a 1-token prefill leg.
_PREFILL_DROP = ("stream_options", "min_tokens", "n", "best_of", "logprobs", "top_logprobs", "echo")


@dataclass(frozen=True)
class ClientRequest:
    """A validated client request: which endpoint, the body, and what the router needs from it."""

    path: str
    body: dict[str, Any]
    stream: bool


def validate(path: str, body: Any, model: str | None) -> ClientRequest:
    """Reject what the P/D path cannot serve with a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if model is not None and body.get("model") not in (None, model):
        raise ApiError(404, f"model {body.get('model')!r} does not exist; this router serves {model!r}",
                       code="model_not_found", param="model")  # fmt: skip
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not _is_token_list(prompt):
            raise bad_request("prompt must be one non-empty string or one list of token ids", "prompt")
    elif path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("messages must be a non-empty list of message objects", "messages")
    else:
        raise ApiError(404, f"unknown endpoint {path}", code="not_found")
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise bad_request("n and best_of other than 1 are not supported on the P/D path", "n")
    if "kv_transfer_params" in body:
        raise bad_request("kv_transfer_params is set by the router, not by clients", "kv_transfer_params")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad_request(f"{name} must be a positive integer", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    return ClientRequest(path=path, body=body, stream=stream)


def _is_token_list(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def vllm_request_id(path: str, router_id: str) -> str:
    """The base id vLLM gives the request for X-Request-Id (completions add `-<prompt index>`)."""
    return f"cmpl-{router_id}-0" if path == COMPLETIONS else f"chatcmpl-{router_id}"


def prefill_params(
    mode: str, router_id: str, attempt: int, decode: Endpoint, transfer_s: float
) -> dict[str, Any]:
    if mode == "kvferry":
        return ProducerParams(router_id, attempt, decode.engine_id, transfer_s).kv_transfer_params()
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def decode_params(
    mode: str,
    path: str,
    router_id: str,
    attempt: int,
    prefill: Endpoint,
    transfer_s: float,
    prefill_response: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if mode == "kvferry":
        p = prefill
        return ConsumerParams(
            router_id, attempt, p.engine_id, p.side_host, p.side_port, p.tp_size, transfer_s
        ).kv_transfer_params()
    if mode == "vllm-push":
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": prefill.engine_id,
            "remote_host": prefill.side_host,
            "remote_port": prefill.side_port,
            "tp_size": prefill.tp_size,
            "pp_size": 1,
            "remote_request_id": vllm_request_id(path, router_id),
        }
    if mode == "vllm-pull":
        if not prefill_response:
            raise ValueError("pull mode forwards the prefill response's kv_transfer_params; got none")
        return dict(prefill_response)
    raise ValueError(f"unknown mode {mode!r}")


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The client body as a 1-token, non-streaming prefill with the given kv_transfer_params.

    Leg bodies are shallow copies: they share the prompt (often thousands of token ids) with the
    client's body, and nothing changes a nested value (a deep copy of a 1024-token prompt took ~1 ms
    of the router's loop per leg, on the TTFT path)."""
    out = dict(body)
    for name in _PREFILL_DROP:
        out.pop(name, None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = params
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The client body as sent to decode (None params: a plain local recompute); shallow, as above."""
    out = dict(body)
    if params is not None:
        out["kv_transfer_params"] = params
    return out
