"""Intake step: a received notification -> a trusted protocol message, or the reason it is ignored.

Pure (no I/O). Trust comes from the transport, not from the message: the sender's engine, TP rank and
incarnation are the ones in its NIXL agent name (`<engine>/<rank>/<incarnation>`), and the message's
own claims must match them (a rank may speak only for itself; a registration names the side channel
of the very agent that sent it); a peer of another revision (docs/security.md) or a message this
role does not take is refused, except a Failure (no KV, only "I will not write").
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


def parse_agent(agent_name: str) -> tuple[str, int, str] | None:
    """(engine, rank, incarnation) of an agent name, None if it is not of that form."""
    parts = agent_name.rsplit("/", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or len(parts[1]) > 6:
        return None
    return parts[0], int(parts[1]), parts[2]


def admit(raw: bytes, sender_agent: str, role: str, revision: str) -> Message | Reject:
    named = parse_agent(sender_agent)
    if named is None:  # not one of ours: every agent an endpoint creates is named this way
        return Reject("unexpected_engine", f"sender agent {sender_agent[:80]!r} is not <engine>/<rank>/<id>")
    sender, rank, incarnation = named
    try:
        msg = decode(raw)
    except WireError as exc:
        return Reject("malformed", f"from {sender}: {exc}")
    claimed = getattr(msg, "consumer_engine", None) or getattr(msg, "producer_engine", None)
    if claimed != sender:
        return Reject("unexpected_engine", f"{type(msg).__name__} claiming {claimed} sent by {sender}")
    claimed_rank = getattr(msg, "consumer_rank", None)
    claimed_rank = getattr(msg, "producer_rank", None) if claimed_rank is None else claimed_rank
    if claimed_rank is not None and claimed_rank != rank:
        return Reject(
            "unexpected_rank", f"{type(msg).__name__} for rank {claimed_rank} sent by {sender_agent}"
        )
    if isinstance(msg, Registration) and msg.incarnation != incarnation:
        return Reject("unexpected_engine", f"registration naming incarnation {msg.incarnation!r} sent by "
                      f"{sender_agent}")  # fmt: skip
    theirs = getattr(msg, "revision", revision)
    # P and D of different revisions never exchange KV. A Failure carries none: it only tells a
    # consumer that this verified producer rank will not write, which it must hear to free blocks.
    if theirs != revision and not (isinstance(msg, Failure) and role == "consumer"):
        return Reject("wrong_revision", f"{type(msg).__name__} of revision {theirs!r} from {sender}")
    if not isinstance(msg, TAKES[role]):
        return Reject("unexpected_message", f"{type(msg).__name__} from {sender} on a {role}")
    if isinstance(msg, Registration) and msg.deadline_unix <= 0:
        return Reject("malformed", f"registration for {msg.request_id} from {sender} without a deadline")
    return msg
