"""Intake step: a received notification -> a trusted protocol message, or the reason it is ignored.

Pure (no I/O). Trust comes from the transport, not from the message: the sender's engine is the one in
its NIXL agent name (`<engine>/<rank>/<incarnation>`), and the message's own claim must match it; a
peer of another revision (docs/security.md) or a message this role does not take is refused.
"""

from __future__ import annotations

from kvferry.connector.actions import Reject
from kvferry.connector.wire import Cancel, Done, Failure, Message, Registration, WireError, decode

# Typed by the Message union: inferred, tuples of the common base class, mypy would see every message match.
TAKES: dict[str, tuple[type[Message], ...]] = {
    "producer": (Registration, Cancel),
    "consumer": (Done, Failure),
}


def engine_of(agent_name: str) -> str:
    """Agent names are `<engine>/<rank>/<incarnation>`: the sender's engine, verified on every message."""
    return agent_name.rsplit("/", 2)[0]


def admit(raw: bytes, sender_agent: str, role: str, revision: str) -> Message | Reject:
    sender = engine_of(sender_agent)
    try:
        msg = decode(raw)
    except WireError as exc:
        return Reject("malformed", f"from {sender}: {exc}")
    claimed = getattr(msg, "consumer_engine", None) or getattr(msg, "producer_engine", None)
    if claimed != sender:
        return Reject("unexpected_engine", f"{type(msg).__name__} claiming {claimed} sent by {sender}")
    theirs = getattr(msg, "revision", revision)
    if theirs != revision:  # P and D of different revisions never exchange KV
        return Reject("wrong_revision", f"{type(msg).__name__} of revision {theirs!r} from {sender}")
    if not isinstance(msg, TAKES[role]):
        return Reject("unexpected_message", f"{type(msg).__name__} from {sender} on a {role}")
    if isinstance(msg, Registration) and msg.deadline_unix <= 0:
        return Reject("malformed", f"registration for {msg.request_id} from {sender} without a deadline")
    return msg
