"""Shard step: which operator replica serves a CR (pure).

Several replicas split the CRs between them instead of one leader doing all the work: replica i of n
serves the CRs whose "namespace/name" hashes to i. The hash is CRC-32 (stable across processes and
Python versions, unlike hash()), so every replica computes the same owner for a CR without talking to
the others, and a CR keeps its owner for its whole life (a CR's name and namespace never change).
Splitting by namespace instead needs no hash: give each replica its own --namespace list.
"""

from __future__ import annotations

import zlib


def shard_of(namespace: str, name: str, count: int) -> int:
    """The shard (0..count-1) a CR belongs to."""
    return zlib.crc32(f"{namespace}/{name}".encode()) % count


def owns(namespace: str, name: str, index: int, count: int) -> bool:
    """Whether replica `index` of `count` serves the CR namespace/name."""
    return count <= 1 or shard_of(namespace, name, count) == index
