"""Kubernetes quantities (`500m`, `16Gi`, `1e3`) as exact values, bounded before any arithmetic (pure).

apimachinery's `resource.ParseQuantity` accepts `<number><suffix>` with a decimal exponent of any
int32, rounds every non-zero value up to 1n and caps binary-suffixed values at 2^63-1. An exponent
is a lever: `10**exponent` of a CR's `limits.cpu: 1e999999999` is a ~415 MB integer built while
holding the GIL (and the API server's own `Round` of it as long). So:

- `quantity()` refuses (None) any text longer than MAX_CHARS or with |exponent| > MAX_EXPONENT before
  computing anything; within those bounds it is exact and rounds and caps as Kubernetes does, so a
  rendered value and the API server's canonical form of it compare equal;
- `spec_quantity()` is what a CR may hand in (`resources.limits` / `requests` values): non-negative,
  at most SPEC_MAX_CHARS characters, a decimal exponent of at most two digits. The CRD checks the
  same with `SPEC_PATTERN` ahead of CEL's `isQuantity` (rules.py), so the API server never parses a
  hostile exponent either.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

MAX_CHARS = 64  # longer text is not compared by value (a stored canonical quantity is far shorter)
MAX_EXPONENT = 100  # |e| beyond this is refused: 10**100 is still instant, 10**10**9 is not
SPEC_MAX_CHARS = 32
INT64_MAX = 2**63 - 1
NANO = Fraction(1, 10**9)

_SUFFIX: dict[str, int | Fraction] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_BINARY = {"Ki", "Mi", "Gi", "Ti", "Pi", "Ei"}
_SUFFIXES = "|".join(_SUFFIX)
# Kubernetes' grammar: <sign><digits>[.<digits>] then a SI suffix, a binary suffix or e<signed int>.
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|(" + _SUFFIXES + "))?$")
# What a CR may hand in (RE2 and Python re alike): no sign, <= 18 integer and 9 fraction digits,
# a two-digit exponent at most; the length bound is SPEC_MAX_CHARS. ([.], not an escape: CEL
# string literals have no `\.`.)
SPEC_PATTERN = "^([0-9]{1,18}([.][0-9]{0,9})?|[.][0-9]{1,9})(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]{1,2}))?$"
_SPEC = re.compile(SPEC_PATTERN)


def quantity(value: Any) -> Fraction | None:
    """The value Kubernetes stores for quantity `value`, or None if it is not one or out of bounds."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        value = str(value)
    text = str(value).strip()
    if len(text) > MAX_CHARS:
        return None
    match = _QUANTITY.match(text)
    if match is None:
        return None
    number, exponent, suffix = match.groups()
    if exponent is not None:
        power = int(exponent)  # at most MAX_CHARS digits: cheap
        if abs(power) > MAX_EXPONENT:
            return None
        scale: int | Fraction = Fraction(10) ** power
    else:
        scale = _SUFFIX.get(suffix or "", 1)
    amount = Fraction(number) * scale
    sign = -1 if amount < 0 else 1
    amount = abs(amount)
    if amount:  # Kubernetes rounds up to the nearest 1n ("if you want some, you get some")
        amount = Fraction(math.ceil(amount / NANO)) * NANO
    if suffix in _BINARY and amount > INT64_MAX:
        amount = Fraction(INT64_MAX)
    return sign * amount


def spec_quantity(value: Any) -> bool:
    """Whether a CR may hand in `value` as a resource quantity (an int >= 0 or SPEC_PATTERN text)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return 0 <= value <= INT64_MAX
    return (
        isinstance(value, str)
        and len(value) <= SPEC_MAX_CHARS
        and _SPEC.match(value) is not None
        and quantity(value) is not None
    )
