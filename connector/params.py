"""Params step: the `kvferry` block of kv_transfer_params (docs/contracts.md §1), parsed strictly.

Pure (no vLLM): the scheduler calls `parse()` on every request that carries kv_transfer_params and
turns a `ParamsError` into a reported failure of that one request, never an engine crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONTRACT_VERSION = 1
MAX_DEADLINE_S = 3600.0  # the CRD's deadlineSeconds bound: nothing waits longer, whatever a client sends


class ParamsError(ValueError):
    """A missing or malformed kvferry block; the message names the field."""


@dataclass(frozen=True)
class ProducerParams:
    """Prefill leg: who will consume this request's KV."""

    request_id: str
    attempt: int
    consumer_engine: str
    deadline_s: float


@dataclass(frozen=True)
class ConsumerParams:
    """Decode leg: which producer computes this request's KV and how to reach its side channel."""

    request_id: str
    attempt: int
    producer_engine: str
    producer_host: str
    producer_port: int
    producer_tp: int
    deadline_s: float


def wants_transfer(params: dict[str, Any] | None) -> str | None:
    """'producer' / 'consumer' when the params ask for a P/D transfer, else None."""
    if not params:
        return None
    if params.get("do_remote_prefill"):
        return "consumer"
    if params.get("do_remote_decode"):
        return "producer"
    return None


def parse(params: dict[str, Any], role: str, default_deadline_s: float) -> ProducerParams | ConsumerParams:
    block = params.get("kvferry")
    if not isinstance(block, dict):
        raise ParamsError(
            "kv_transfer_params.kvferry is missing (the kvferry connector needs the router's "
            "kvferry block, docs/contracts.md §1)"
        )
    f = _Fields(block)
    if f.int_("v") != CONTRACT_VERSION:
        raise ParamsError(
            f"kv_transfer_params.kvferry.v={block.get('v')!r}, this connector speaks {CONTRACT_VERSION}"
        )
    want = "producer" if role == "producer" else "consumer"
    if f.str_("role") != want:
        raise ParamsError(f"kv_transfer_params.kvferry.role={block.get('role')!r} sent to a {want}")
    deadline = f.float_("deadline_s", default_deadline_s)
    if role == "producer":
        peer = _Fields(f.dict_("consumer"), "consumer.")
        return ProducerParams(f.str_("request_id"), f.int_("attempt"), peer.str_("engine_id"), deadline)
    peer = _Fields(f.dict_("producer"), "producer.")
    tp = peer.int_("tp_size")
    if tp < 1:
        raise ParamsError(f"kv_transfer_params.kvferry.producer.tp_size must be >= 1, got {tp}")
    port = peer.int_("port")
    if not 0 < port < 65536:
        raise ParamsError(f"kv_transfer_params.kvferry.producer.port={port} is not a TCP port")
    return ConsumerParams(
        f.str_("request_id"), f.int_("attempt"), peer.str_("engine_id"), peer.str_("host"), port, tp, deadline
    )


class _Fields:
    def __init__(self, block: dict[str, Any], prefix: str = "") -> None:
        self.block, self.prefix = block, prefix

    def _get(self, key: str) -> Any:
        if key not in self.block:
            raise ParamsError(f"kv_transfer_params.kvferry.{self.prefix}{key} is missing")
        return self.block[key]

    def _bad(self, key: str, want: str) -> ParamsError:
        return ParamsError(
            f"kv_transfer_params.kvferry.{self.prefix}{key} must be {want}, got {self.block[key]!r}"
        )

    def str_(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not value:
            raise self._bad(key, "a non-empty string")
        return value

    def int_(self, key: str) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._bad(key, "a non-negative integer")
        return value

    def float_(self, key: str, default: float) -> float:
        if key not in self.block:
            return default
        value = self.block[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_DEADLINE_S:
            raise self._bad(key, f"a positive number of seconds up to {MAX_DEADLINE_S:g}")
        return float(value)

    def dict_(self, key: str) -> dict[str, Any]:
        value = self._get(key)
        if not isinstance(value, dict):
            raise self._bad(key, "an object")
        return value
