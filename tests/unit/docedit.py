"""Test helper: a deep copy of a nested document with one value replaced or (value=KeyError) removed."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any


def mutated(base: Any, path: Sequence[Any], value: Any) -> Any:
    out = copy.deepcopy(base)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out
