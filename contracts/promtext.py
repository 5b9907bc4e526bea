"""Prometheus text exposition (format 0.0.4) as samples: the one parser the router, operator and tools use.

The connector and vLLM export metrics in this format (prometheus_client writes it); the operator's
transfer status and autoscaler, the router's tests and the tools read it back. It lives in contracts
because both the router and the operator read it and may import nothing of each other, and because
it is stdlib only, like everything here.

Hand-written rather than prometheus_client's parser for cost: on a vLLM engine's /metrics it takes
about a quarter of the library's CPU time (~50 ms per MiB against ~200; bench/promtext_bench.py),
and the operator parses every engine pod's text every interval. Same reading as the library's where the
consumers look: sample names as written (a counter's `_total`, a histogram's `_bucket`, `_sum`,
`_count`), labels with `\\\\`, `\\"` and `\\n` unescaped, values as floats (`NaN`, `+Inf`, `-Inf`),
timestamps dropped, `#` lines and blank lines skipped. A line that is neither raises ValueError. An
untrusted text is cut to the families read before it gets here (operator/status/metricstext.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import NamedTuple

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
_VALUE = r'"(?:[^"\\]|\\.)*"'
_ITEM = rf"[ \t]*{_LABEL_NAME}[ \t]*=[ \t]*{_VALUE}[ \t]*"
# A sample line: name, optional label set (trailing comma allowed), value, optional timestamp. The label
# set is checked here, in the regex engine; _PAIR then picks its pairs out of the checked text.
_SAMPLE = re.compile(
    rf"({_NAME})(?:[ \t]*\{{({_ITEM}(?:,{_ITEM})*(?:,[ \t]*)?|[ \t]*)\}}[ \t]*|[ \t]+)"
    r"([^ \t]+)(?:[ \t]+([^ \t]+))?"
)
_PAIR = re.compile(rf'({_LABEL_NAME})[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def _number(token: str) -> float:
    if "_" in token:  # float() reads "1_000"; the exposition format does not
        raise ValueError(f"invalid value {token!r}")
    return float(token)


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda e: _UNESCAPED[e.group(0)], value) if "\\" in value else value


def _labels(body: str) -> dict[str, str]:
    pairs = _PAIR.findall(body)
    labels = {k: _unescape(v) for k, v in pairs}
    if len(labels) != len(pairs):
        raise ValueError(f"a label twice in {{{body[:80]}}}")
    return labels


def sample(line: str) -> Sample:
    """One sample line (stripped). Raises ValueError on anything else."""
    match = _SAMPLE.fullmatch(line)
    if match is None:
        raise ValueError(f"not a sample line: {line[:80]!r}")
    name, body, value, timestamp = match.groups()
    if timestamp is not None:
        _number(timestamp)
    return Sample(name, _labels(body) if body else {}, _number(value))


def samples(text: str) -> Iterator[Sample]:
    """Every sample of `text`, in order. Raises ValueError on a line that is no exposition."""
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            yield sample(line)


def key(name: str, labels: Mapping[str, str]) -> str:
    """'name{k="v",...}' with labels sorted, so one series has one key."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {key(name, labels): value}."""
    return {key(s.name, s.labels): s.value for s in samples(text)}


def metric_sum(metrics: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include all of `labels` (keys of parse_metrics)."""
    total = 0.0
    for series, value in metrics.items():
        base, _, rest = series.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
