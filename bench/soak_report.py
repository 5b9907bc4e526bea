"""The report of a soak run (bench/soak.py): its summary, the pass rule and the table.

The summary counts every request by its class (soak.py's docstring), with examples of lost and
avoidable errors, the faults as they fired, the gauges after settling, memory and /dev/shm, and the
router's and engines' counters read at the end; `passed` is the rule soak.py exits by.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import httpx
from kvferry.contracts.promtext import parse_metrics

if TYPE_CHECKING:
    from soak import Soak

COUNTERS = ("kvferry_transfers_total", "kvferry_transfer_failures_total", "kvferry_rejected_messages_total")


def summarize(soak: Soak, gauges: dict[str, float], settle_s: float, wall_s: float) -> dict[str, Any]:
    outs, cfg = soak.outcomes, soak.cfg
    counts = Counter(o.result for o in outs)
    errors, lost = [o for o in outs if o.result == "error"], [o for o in outs if o.result == "lost"]
    avoidable = [o for o in outs if o.avoidable]
    router = parse_metrics(httpx.get(soak.stack.url + "/metrics", timeout=10).text)
    answered = sorted(o.end - o.start for o in outs if o.result in ("ok", "recomputed"))
    examples = lambda os_: [  # noqa: E731
        {**asdict(o.req), "status": o.status, "code": o.code, "detail": o.detail, "s": o.end - o.start}
        for o in os_[:8]
    ]  # fmt: skip
    t0 = min((o.start for o in outs), default=0.0)
    return {
        "config": {k: v for k, v in asdict(cfg).items() if k != "ready_timeout_s"},
        "requests": len(outs), "ok": counts["ok"], "recomputed": counts["recomputed"], "errors": len(errors),
        "avoidable": len(avoidable), "cancelled": counts["cancelled"], "lost": len(lost),
        "errors_by_code": dict(Counter(o.code for o in errors)),
        "avoidable_by_code": dict(Counter(o.code for o in avoidable)),
        "recomputed_by_reason": dict(Counter(o.code for o in outs if o.result == "recomputed")),
        "lost_examples": examples(lost), "avoidable_examples": examples(avoidable),
        "over_total_s": sum(o.end - o.start > cfg.deadlines["total_s"] for o in outs if o.result != "lost"),
        "answer_s": {"p50": statistics.median(answered), "max": answered[-1]} if answered else {},
        "faults": [
            {"kind": f.kind, "at_request": f.fired_at, "at_s": round(f.started - t0, 1), "detail": f.detail}
            for f in soak.faults
        ],
        "gauges": gauges, "gauges_ok": not any(gauges.values()), "settle_s": round(settle_s, 1),
        "memory": soak.memory.report(),
        "shm": dict(zip(("orphans", "held_by_live_engine"), soak.stack.orphan_shm(), strict=True)),
        "router_counters": {
            k: v for k, v in router.items()
            if k.startswith(("kvferry_router_requests_total", "kvferry_router_recomputes_total",
                             "kvferry_router_leg_errors_total", "kvferry_router_errors_total")) and v
        },
        "engine_counters": soak.stack.engine_metrics(COUNTERS), "engines_exited": soak.stack.exited(),
        "wall_s": round(wall_s, 1), "workdir": str(soak.stack.workdir),
    }  # fmt: skip


def passed(s: dict[str, Any]) -> bool:
    return s["lost"] == 0 and s["avoidable"] == 0 and s["gauges_ok"] and not s["engines_exited"]


def table(s: dict[str, Any]) -> str:
    rows = [
        ("requests", s["requests"]), ("ok", s["ok"]),
        ("recomputed", f"{s['recomputed']} {s['recomputed_by_reason'] or ''}"),
        ("clear errors", f"{s['errors']} {s['errors_by_code'] or ''}"),
        ("avoidable errors (must be 0)", f"{s['avoidable']} {s['avoidable_by_code'] or ''}"),
        ("cancelled by the client", s["cancelled"]), ("lost (must be 0)", s["lost"]),
        ("ended after total_s (within slack)", s["over_total_s"]),
        ("gauges back to 0 (must be)", f"{'yes' if s['gauges_ok'] else 'NO'} after {s['settle_s']}s"),
    ]  # fmt: skip
    rows += [(f"  gauge {k}", v) for k, v in s["gauges"].items() if v]
    rows += [(f"fault {f['kind']} @ {f['at_request']} ({f['at_s']}s)", f["detail"]) for f in s["faults"]]
    for role, m in s["memory"].items():
        rss = f"start {m['start_mib']:.0f}, peak {m['peak_mib']:.0f}, end {m['end_mib']:.0f}"
        growth = f"{m['growth_mib']:+.1f}, in its second half {m['late_growth_mib']:+.1f}"
        rows.append((f"RSS {role} MiB (x{m['incarnations']})", f"{rss}; last incarnation's growth {growth}"))
    shm = (len(s["shm"]["orphans"]), len(s["shm"]["held_by_live_engine"]))
    rows.append(("killed engines' /dev/shm files left (orphaned, held by a live engine)", shm))
    rows += (
        [("engines that exited by themselves (must be none)", s["engines_exited"])]
        if s["engines_exited"]
        else []
    )
    rows.append(("result", "PASS" if passed(s) else "FAIL"))
    return "| what | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
