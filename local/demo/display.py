"""Display step: what the demo shows while it runs (rich): step progress, pods, `kubectl get`, traffic.

Rendering only: callers pass plain data in and get rich renderables out, so the flow in `cli.py`
reads top to bottom and the view can change without touching it.
"""

from __future__ import annotations

from typing import Any

from kvferry.local.demo.traffic import Counters
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def pods_line(pods: list[dict[str, Any]]) -> str:
    """One line per pod state, for the progress bar while pods come up."""
    parts = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        st = pod.get("status") or {}
        ready = (
            "ready"
            if any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
            else ""
        )
        parts.append(f"{pod['metadata']['name']} {st.get('phase', 'Pending')} {ready}".strip())
    return ", ".join(parts) or "waiting for the operator to create pods"


def pods_table(pods: list[dict[str, Any]]) -> Table:
    table = Table(title="pods (node cpu-0, local processes)", expand=True)
    for col in ("pod", "phase", "ready", "restarts", "pod IP", "cores"):
        table.add_column(col)
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        st = pod.get("status") or {}
        cs = (st.get("containerStatuses") or [{}])[0]
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
        table.add_row(
            pod["metadata"]["name"],
            "Terminating" if pod["metadata"].get("deletionTimestamp") else st.get("phase", "Pending"),
            Text("yes", style="green") if ready else Text("no", style="yellow"),
            str(cs.get("restartCount", 0)),
            st.get("podIP", ""),
            pod.get("_cores", ""),
        )
    return table


def traffic_panel(url: str, c: Counters) -> Panel:
    p50 = c.p50_ms()
    lines = [
        f"router {url}  (pod IP: no kube-proxy here, the demo calls the router pod directly)",
        f"requests sent {c.sent}   ok {c.ok}   failed {c.failed}   "
        f"client latency p50 {'-' if p50 is None else f'{p50:.0f} ms'}",
    ]
    if c.last_error:
        lines.append(f"last error: {c.last_error}")
    return Panel("\n".join(lines), title="client")


def view(kubectl_get: str, pods: list[dict[str, Any]], url: str, counters: Counters, hint: str) -> Group:
    return Group(
        Panel(kubectl_get or "(no output yet)", title="kubectl get disaggregatedinferences"),
        pods_table(pods),
        traffic_panel(url, counters),
        Text(hint, style="dim"),
    )
