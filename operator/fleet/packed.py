"""Packed copies: a JSON object kept as compressed compact text, parsed only when read (pure, stdlib).

The operator keeps a copy of every CR and managed object it watches (handlers.py's indexes) and of each
CR as its last status write stored it (status/publish.py). Parsed, a copy is ~10x its JSON text in
memory and the text ~4x its zlib; readers parse the copies of one CR at a time (memory at
1,000 CRs).
"""

from __future__ import annotations

import json
import zlib
from typing import Any


def pack(obj: dict[str, Any]) -> bytes:
    return zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 1)


def unpack(packed: bytes | None) -> dict[str, Any] | None:
    """The object packed, as fresh dicts of the caller's own (None stays None)."""
    return None if packed is None else json.loads(zlib.decompress(packed))
