"""The table of an operator bench run (bench/operator_bench.py): one column per design, a dash where a
design has no such figure (the floor runs no operator). A sharded column sums its replicas' requests,
reconciles, CPU and peaks, and lists each replica's peak beside the sum.
"""

from __future__ import annotations

from typing import Any


def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "not reached"
    return f"{value:.{digits}f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _cell(fn: Any) -> Any:
    """A table cell that shows "—" where a design has no such figure (the floor has no operator)."""

    def cell(r: dict[str, Any]) -> str:
        try:
            return fn(r)
        except KeyError:
            return "—"

    return cell


def _of(r: dict[str, Any]) -> str:
    """How many objects were there when the wait gave up."""
    return f" ({r['objects']}/{r['objects_want']})" if r["objects_s"] is None and "objects" in r else ""


def _per_cr_mib(r: dict[str, Any]) -> str:
    return _fmt((r["peak_rss_mib"] - r["idle_rss_mib"]) / r["crs"], " MiB", 2)


ROWS = [
    ("all CRs created (8 clients)", lambda r: _fmt(r["apply_s"] if "apply_s" in r else r["created_s"], " s")),
    ("all objects present (from the first create)", lambda r: _fmt(r["objects_s"], " s") + _of(r)),
    (
        "all CRs Ready (from the first create)",
        lambda r: _fmt(r["ready_s"], " s") + f" ({r['ready_count']}/{r['crs']})",
    ),
    ("CRs with all workloads ready, then", lambda r: f"{r['workloads_ready']}/{r['crs']}"),
    ("full reconciles per CR", lambda r: _fmt(r["full_reconciles"] / r["crs"], "", 2)),
    ("API requests per full reconcile", lambda r: _fmt(r["requests"] / max(r["full_reconciles"], 1))),
    ("API requests per CR", lambda r: _fmt(r["requests"] / r["crs"])),
    ("peak memory (operator; floor: its client; shards: sum)", lambda r: _fmt(r["peak_rss_mib"], " MiB", 0)),
    ("peak memory of each replica", lambda r: " / ".join(_fmt(m, " MiB", 0) for m in r["peak_rss_each"])),
    ("operator memory per CR (peak − idle; shards: sums)", _per_cr_mib),
    ("CPU s to all Ready: API server", lambda r: _fmt(r["cpu_s"]["kube-apiserver"], " s", 0)),
    (
        "CPU s to all Ready: controller-manager",
        lambda r: _fmt(r["cpu_s"]["kube-controller-manager"], " s", 0),
    ),
    ("CPU s to all Ready: operator (floor: client)", lambda r: _fmt(r["cpu_s"]["client"], " s", 0)),
    ("status lag after a metrics change", lambda r: _fmt(r["lag_s"], " s")),
    (
        "reconciles by trigger",
        lambda r: ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["by_trigger"].items())),
    ),
]


def table(results: list[dict[str, Any]]) -> str:
    head = "| figure | " + " | ".join(r["design"] for r in results) + " |"
    lines = [head, "|---" * (len(results) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(_cell(fn)(r) for r in results) + " |" for name, fn in ROWS]
    return "\n".join(lines)
