"""Results step: what finished since the caller last took them (written by the endpoint thread)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.connector.actions import Key


@dataclass
class Results:
    """What finished since the last take: keys with reasons."""

    sent: list[Key] = field(default_factory=list)  # producer: source blocks may be freed
    released: list[tuple[Key, str]] = field(default_factory=list)  # producer: freed without a full send
    received: list[Key] = field(default_factory=list)  # consumer: KV landed
    failed: list[tuple[Key, str]] = field(default_factory=list)  # consumer: KV will not land

    def __bool__(self) -> bool:
        return bool(self.sent or self.released or self.received or self.failed)
