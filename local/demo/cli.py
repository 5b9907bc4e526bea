"""Demo step: `kvferry demo` runs the whole stack on this machine and shows it working.

control plane -> CRD -> operator -> node agent -> DisaggregatedInference -> vLLM P/D pods -> router,
then a stream of requests while `kubectl get disaggregatedinferences` updates. Ctrl-C (or
--duration) tears everything down; nothing is left running.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from kvferry.local.demo import display
from kvferry.local.demo.stack import Stack, StackError, demo_cr, pod_ready, wait_until
from kvferry.local.demo.traffic import RequestStream
from rich.console import Console
from rich.live import Live
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

PODS_READY_TIMEOUT_S = 900.0  # two cold vLLM starts on a busy 2-core machine
REFRESH_S = 3.0


class _ProgressWriter:
    """A file-like `out` for the build: each printed line becomes the progress task's description."""

    def __init__(self, progress: Progress, task: Any, prefix: str) -> None:
        self.progress, self.task, self.prefix = progress, task, prefix

    def write(self, text: str) -> None:
        if text.strip():
            self.progress.update(self.task, description=f"{self.prefix}: {text.strip()[-90:]}")

    def flush(self) -> None:
        pass


def _step(progress: Progress, title: str, fn, *args: Any) -> Any:
    task = progress.add_task(title, total=None)
    t0 = time.monotonic()
    result = fn(*args)
    progress.update(
        task, description=f"[green]✓[/green] {title} ({time.monotonic() - t0:.0f} s)", total=1, completed=1
    )
    return result


def bring_up(stack: Stack, progress: Progress, namespace: str, name: str) -> str:
    """Every step up to a Ready router; returns its URL."""
    build_task = progress.add_task(
        "control-plane binaries and tiny model (first run compiles Kubernetes)", total=None
    )
    t0 = time.monotonic()
    stack.build(out=_ProgressWriter(progress, build_task, "build"))
    done = f"[green]✓[/green] binaries and tiny model ({time.monotonic() - t0:.0f} s)"
    progress.update(build_task, description=done, total=1, completed=1)
    _step(
        progress,
        "control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok)",
        stack.start_plane,
    )
    _step(progress, "CRD disaggregatedinferences.kvferry.io", stack.install_crd)
    _step(progress, "operator (kopf, own process)", stack.start_operator)
    _step(progress, "node agent for cpu-0 (pods become local processes)", stack.start_agent)
    assert stack.model is not None
    stack.ensure_namespace(namespace)
    _step(
        progress,
        f"apply DisaggregatedInference {namespace}/{name}",
        stack.apply,
        demo_cr(name, namespace, stack.model),
    )
    task = progress.add_task("pods starting", total=None)

    def all_ready() -> str | None:
        pods = stack.pods(namespace, f"kvferry.io/name={name}")
        progress.update(task, description=f"pods: {display.pods_line(pods)}")
        roles = {p["metadata"]["labels"].get("kvferry.io/role") for p in pods if pod_ready(p)}
        return stack.router_url(namespace, name) if {"prefill", "decode", "router"} <= roles else None

    t0 = time.monotonic()
    url = wait_until("prefill, decode and router pods Ready", all_ready, PODS_READY_TIMEOUT_S)
    progress.update(
        task, description=f"[green]✓[/green] pods Ready ({time.monotonic() - t0:.0f} s)", total=1, completed=1
    )
    return url


def watch(stack: Stack, console: Console, namespace: str, name: str, url: str, duration_s: float) -> None:
    """Requests through the router while the view refreshes, until Ctrl-C or `duration_s`."""
    stream = RequestStream(url)
    stream.start()
    hint = "Ctrl-C tears everything down" + (f"; stopping after {duration_s:.0f} s" if duration_s else "")
    end = time.monotonic() + duration_s if duration_s else float("inf")
    try:
        if console.is_terminal:
            with Live(console=console, refresh_per_second=2) as live:
                while time.monotonic() < end:
                    pods = stack.pods(namespace, f"kvferry.io/name={name}")
                    live.update(
                        display.view(stack.kubectl_get(namespace), pods, url, stream.snapshot(), hint)
                    )
                    time.sleep(REFRESH_S)
        else:
            _log_changes(stack, console, namespace, stream, end)
    finally:
        stream.stop()
    console.print(stack.kubectl_get(namespace))
    c = stream.snapshot()
    console.print(f"client: sent {c.sent}, ok {c.ok}, failed {c.failed}")


def _log_changes(stack: Stack, console: Console, namespace: str, stream: RequestStream, end: float) -> None:
    """Without a terminal (CI logs): print the `kubectl get` row each time it changes."""
    last = ""
    console.print(f"time     {stack.kubectl_get(namespace).splitlines()[0]}", soft_wrap=True)
    while time.monotonic() < end:
        rows = stack.kubectl_get(namespace).splitlines()
        row = rows[-1] if rows else ""
        if row != last:
            c = stream.snapshot()
            console.print(
                f"{time.strftime('%H:%M:%S')} {row}   [client ok {c.ok} failed {c.failed}]", soft_wrap=True
            )
            last = row
        time.sleep(REFRESH_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, default=None, help="logs, kubeconfig, pod files (default: temp)"
    )
    parser.add_argument("--namespace", default="kvferry-demo")
    parser.add_argument("--name", default="tiny")
    parser.add_argument(
        "--duration", type=float, default=0.0, help="seconds of traffic, then stop (0: until Ctrl-C)"
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvferry-demo-"))
    console = Console()
    console.print(f"[bold]kvferry demo[/bold]: logs and kubeconfig under {workdir}")
    stack = Stack(workdir, report=console.print)
    code = 0
    try:
        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console
        ) as progress:
            url = bring_up(stack, progress, args.namespace, args.name)
        console.print(
            f"router: {url}   try: curl {url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model":"tiny","prompt":"ferry","max_tokens":8}}\''
        )
        console.print(
            f"kubectl: KUBECONFIG={workdir}/controlplane/admin.kubeconfig "
            "kubectl get disaggregatedinferences -A"
        )
        watch(stack, console, args.namespace, args.name, url, args.duration)
    except KeyboardInterrupt:
        console.print("interrupted")
    except StackError as exc:
        console.print(f"[red]demo failed:[/red] {exc}")
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        with console.status("tearing down: operator, pods, control plane"):
            stack.stop()
        console.print(f"stopped; nothing left running. Logs: {workdir}")
    return code
