"""The case matrix: attention backend x KV cache dtype x KV buffer device x (prefill, decode) block
sizes, grouped by (backend, dtype, buffer device) so one group's servers serve all its cases."""

from __future__ import annotations

from dataclasses import dataclass

KV_BUFFER_DEVICES = ("cuda", "cpu")  # cpu: the connector stages GPU KV through host twins


@dataclass(frozen=True)
class Case:
    attention: str
    kv_dtype: str
    p_block: int
    d_block: int
    kv_buffer_device: str = "cuda"  # kv_transfer_config.kv_buffer_device of both P and D

    @property
    def group(self) -> tuple[str, str, str]:
        return self.attention, self.kv_dtype, self.kv_buffer_device

    @property
    def name(self) -> str:
        return (
            f"{self.attention}/kv={self.kv_dtype}/buf={self.kv_buffer_device}/P{self.p_block}-D{self.d_block}"
        )


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """'16:16,16:32' -> [(16, 16), (16, 32)]."""
    pairs = []
    for part in text.split(","):
        p, sep, d = part.strip().partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) <= 0 or int(d) <= 0:
            raise ValueError(f"block pair {part!r} is not P:D (two positive integers)")
        pairs.append((int(p), int(d)))
    return pairs


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise ValueError(f"{text!r}: give positive integers separated by commas")
    return values


def parse_choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """'cuda,cpu' -> ['cuda', 'cpu']: each one of allowed, in the order given, repeats dropped."""
    values = [v.strip().lower() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise ValueError(f"{what} {text!r}: give one or more of {', '.join(allowed)} separated by commas")
    return list(dict.fromkeys(values))


def matrix(
    attention: list[str],
    kv_dtypes: list[str],
    pairs: list[tuple[int, int]],
    quick: bool = False,
    buffer_devices: list[str] | tuple[str, ...] = ("cuda",),
) -> list[Case]:
    """Every case, grouped by (backend, dtype, buffer device) in order; --quick: the first case only."""
    cases = [
        Case(a, k, p, d, b) for a in attention for k in kv_dtypes for b in buffer_devices for p, d in pairs
    ]
    return cases[:1] if quick else cases


def groups(cases: list[Case]) -> dict[tuple[str, str, str], list[Case]]:
    out: dict[tuple[str, str, str], list[Case]] = {}
    for case in cases:
        out.setdefault(case.group, []).append(case)
    return out
