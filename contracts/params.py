"""kv_transfer_params: the `kvferry` block of each P/D leg (docs/contracts.md §1), defined once.

The router builds legs with `ProducerParams(...).kv_transfer_params()` / `ConsumerParams(...)`; the
connector reads them with `parse()`. Both go through the same checks (`__post_init__`), so the router
cannot write a block the connector would refuse, and every refusal names the field. Pure and
stdlib-only: this runs in the router and inside vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, overload

from kvferry.contracts.versions import PARAMS_VERSION

Role = Literal["producer", "consumer"]
PRODUCER: Role = "producer"
CONSUMER: Role = "consumer"
MAX_DEADLINE_S = 3600.0  # the CRD's deadlineSeconds bound: nothing waits longer, whatever a client sends
# vLLM's own flags that mark a leg as one side of a P/D transfer; the kvferry block rides next to them.
FLAGS: dict[str, str] = {PRODUCER: "do_remote_decode", CONSUMER: "do_remote_prefill"}
BLOCK = "kvferry"
_WHERE = f"kv_transfer_params.{BLOCK}"
# In a prefill's answer (its kv_transfer_params' kvferry block): the last TAIL prompt tokens were left
# for decode to compute (sliding-window models), so the answer's one token is not the request's first.
TAIL = "tail"


def prompt_tail(answer: Any) -> int:
    """How many prompt tokens a prefill's answer left to decode (0: it computed the whole prompt)."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    block = params.get(BLOCK) if isinstance(params, dict) else None
    tail = block.get(TAIL) if isinstance(block, dict) else None
    return tail if type(tail) is int and tail > 0 else 0


class ParamsError(ValueError):
    """A missing or malformed kvferry block; the message names the field."""


@dataclass(frozen=True)
class ProducerParams:
    """Prefill leg: who will consume this request's KV."""

    request_id: str
    attempt: int
    consumer_engine: str
    deadline_s: float

    role: ClassVar[Role] = PRODUCER

    def __post_init__(self) -> None:
        _common(self)
        _str(self.consumer_engine, "consumer.engine_id")

    def to_dict(self) -> dict[str, Any]:
        """The kvferry block."""
        return {
            "v": PARAMS_VERSION,
            "request_id": self.request_id,
            "attempt": self.attempt,
            "role": self.role,
            "consumer": {"engine_id": self.consumer_engine},
            "deadline_s": self.deadline_s,
        }

    def kv_transfer_params(self) -> dict[str, Any]:
        """What the router puts in the prefill leg's body."""
        return {FLAGS[self.role]: True, BLOCK: self.to_dict()}


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

    role: ClassVar[Role] = CONSUMER

    def __post_init__(self) -> None:
        _common(self)
        _str(self.producer_engine, "producer.engine_id")
        _str(self.producer_host, "producer.host")
        port = _count(self.producer_port, "producer.port")
        if not 0 < port < 65536:
            raise ParamsError(f"{_WHERE}.producer.port={port} is not a TCP port")
        tp = _count(self.producer_tp, "producer.tp_size")
        if tp < 1:
            raise ParamsError(f"{_WHERE}.producer.tp_size must be >= 1, got {tp}")

    def to_dict(self) -> dict[str, Any]:
        """The kvferry block."""
        return {
            "v": PARAMS_VERSION,
            "request_id": self.request_id,
            "attempt": self.attempt,
            "role": self.role,
            "producer": {
                "engine_id": self.producer_engine,
                "host": self.producer_host,
                "port": self.producer_port,
                "tp_size": self.producer_tp,
            },
            "deadline_s": self.deadline_s,
        }

    def kv_transfer_params(self) -> dict[str, Any]:
        """What the router puts in the decode leg's body."""
        return {FLAGS[self.role]: True, BLOCK: self.to_dict()}


def wants_transfer(params: Mapping[str, Any] | None) -> Role | None:
    """'producer' / 'consumer' when the params ask for a P/D transfer, else None."""
    if not params:
        return None
    if params.get(FLAGS[CONSUMER]):
        return CONSUMER
    if params.get(FLAGS[PRODUCER]):
        return PRODUCER
    return None


@overload
def parse(
    params: Mapping[str, Any], role: Literal["producer"], default_deadline_s: float
) -> ProducerParams: ...
@overload
def parse(
    params: Mapping[str, Any], role: Literal["consumer"], default_deadline_s: float
) -> ConsumerParams: ...
def parse(
    params: Mapping[str, Any], role: Role, default_deadline_s: float
) -> ProducerParams | ConsumerParams:
    """The kvferry block of one leg's kv_transfer_params, checked strictly (ParamsError names the field).

    `default_deadline_s` (the connector's configured deadline) applies when the block has no deadline_s.
    """
    block = params.get(BLOCK)
    if not isinstance(block, Mapping):
        raise ParamsError(
            f"{_WHERE} is missing (the kvferry connector needs the router's kvferry block, "
            "docs/contracts.md §1)"
        )
    version = _get(block, "v")
    if type(version) is not int or version != PARAMS_VERSION:
        raise ParamsError(f"{_WHERE}.v={version!r}, this connector speaks {PARAMS_VERSION}")
    if _get(block, "role") != role:
        raise ParamsError(f"{_WHERE}.role={block.get('role')!r} sent to a {role}")
    request_id, attempt = _get(block, "request_id"), _get(block, "attempt")
    deadline = block.get("deadline_s", default_deadline_s)
    if role == PRODUCER:
        peer = _object(block, "consumer")
        return ProducerParams(request_id, attempt, _get(peer, "engine_id", "consumer."), deadline)
    peer = _object(block, "producer")
    engine, host, port, tp = (_get(peer, k, "producer.") for k in ("engine_id", "host", "port", "tp_size"))
    return ConsumerParams(request_id, attempt, engine, host, port, tp, deadline)


def _common(p: ProducerParams | ConsumerParams) -> None:
    _str(p.request_id, "request_id")
    _count(p.attempt, "attempt")
    d = p.deadline_s
    if isinstance(d, bool) or not isinstance(d, int | float) or not 0 < d <= MAX_DEADLINE_S:  # NaN fails too
        raise _bad("deadline_s", d, f"a positive number of seconds up to {MAX_DEADLINE_S:g}")
    object.__setattr__(p, "deadline_s", float(d))  # frozen: normalise an int once, here


def _get(block: Mapping[str, Any], key: str, prefix: str = "") -> Any:
    if key not in block:
        raise ParamsError(f"{_WHERE}.{prefix}{key} is missing")
    return block[key]


def _object(block: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = _get(block, key)
    if not isinstance(value, Mapping):
        raise _bad(key, value, "an object")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(path, value, "a non-empty string")
    return value


def _count(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(path, value, "a non-negative integer")
    return value


def _bad(path: str, value: Any, want: str) -> ParamsError:
    return ParamsError(f"{_WHERE}.{path} must be {want}, got {value!r}")
