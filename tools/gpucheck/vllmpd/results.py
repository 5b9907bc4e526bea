"""What one case found and whether it passed: output comparisons against the reference, and the hard
(errors) and soft (warnings) checks on a batch's transfer stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvferry.tools.pdclient import compare

from .cases import Case
from .traffic import Answer, References


@dataclass
class CaseResult:
    case: str
    attention: str
    kv_dtype: str
    p_block: int
    d_block: int
    kv_buffer_device: str = "cuda"
    equal: int = 0
    ties: int = 0
    total: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sequential: dict[str, Any] = field(default_factory=dict)
    burst: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, list[str]] = field(default_factory=dict)
    staged: dict[str, bool | None] = field(default_factory=dict)  # role -> layout line says staged
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and not self.mismatches
            and self.total > 0
            and self.equal + self.ties == self.total
        )


def new_result(case: Case) -> CaseResult:
    return CaseResult(
        case.name, case.attention, case.kv_dtype, case.p_block, case.d_block, case.kv_buffer_device
    )


def score_answers(result: CaseResult, answers: dict[str, Answer], reference: References, tie: float) -> int:
    """Count each answer (a choice, or the exception of its pair) against the reference; returns
    how many pairs completed."""
    completed = 0
    for key, answer in answers.items():
        result.total += 1
        if isinstance(answer, BaseException):
            result.errors.append(f"{key}: {answer}")
            continue
        completed += 1
        want = reference[key]
        status, detail = compare(want["token_ids"], answer.get("token_ids"), want["gaps"], tie)
        if status == "equal":
            result.equal += 1
        elif status == "tie":
            result.ties += 1
            result.warnings.append(f"{key}: parted at a near-tie: {detail}")
        else:
            result.mismatches.append(f"{key}: {detail}")
    return completed


def case_checks(result: CaseResult, stats: dict[str, Any], pairs: int, lengths: list[int], what: str) -> None:
    """Hard checks on one batch's metrics (errors) and soft ones (warnings)."""
    if stats["failures"]:
        result.errors.append(f"{what}: transfer failures {stats['failures']}")
    if stats["consumer_transfers"] != pairs:
        result.errors.append(f"{what}: decode received {stats['consumer_transfers']:g} of {pairs} transfers")
    if stats["kv_bytes"] <= 0:
        result.errors.append(f"{what}: prefill reports no KV bytes moved")
    if stats["producer_transfers"] != pairs:
        result.warnings.append(f"{what}: prefill reported {stats['producer_transfers']:g} of {pairs} WRITEs")
    expected_kv = sum(n - 1 for n in lengths)
    if stats["has_source_metric"] and lengths and stats["tokens_external"] < expected_kv:
        result.errors.append(
            f"{what}: decode got {stats['tokens_external']:g} prompt tokens as KV, expected "
            f">= {expected_kv} (it recomputed instead)"
        )
    if stats["rejected"]:
        result.warnings.append(f"{what}: rejected messages {stats['rejected']}")


def staging_checks(result: CaseResult) -> None:
    """A warning when a server's layout line disagrees with its KV buffer device: on a GPU, cpu
    should stage through host memory and cuda should not (None: no layout line, nothing to say)."""
    want = result.kv_buffer_device == "cpu"
    for role, staged in result.staged.items():
        if staged is not None and staged != want:
            how = "stages through host memory" if staged else "does not stage through host memory"
            result.warnings.append(f"{role} {how} with kv_buffer_device {result.kv_buffer_device}")
