"""Run the real `helm` binary with a time bound and a clear error when it is missing or fails."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

DEFAULT_TIMEOUT_S = 120.0


class HelmError(RuntimeError):
    """helm is missing, timed out, or exited non-zero (the message carries its stderr)."""


def helm_binary() -> str:
    """Path of `helm`: $KVFERRY_HELM, else PATH, else the control plane's bin cache."""
    explicit = os.environ.get("KVFERRY_HELM")
    if explicit:
        return explicit
    found = shutil.which("helm")
    if found:
        return found
    cache = Path(os.environ.get("KVFERRY_BIN", Path.home() / ".cache/kvferry/bin")) / "helm"
    if cache.exists():
        return str(cache)
    raise HelmError(
        "helm not found: run scripts/setup.sh (it builds helm into ~/.cache/kvferry/bin) and "
        "`. scripts/env.sh`, or set KVFERRY_HELM"
    )


@functools.cache
def kube_version(chart: Path) -> str:
    """The oldest Kubernetes the chart supports (Chart.yaml `kubeVersion: ">=X.Y.Z-0"`).

    Helm renders offline as this version, so the output never depends on the helm build's compiled-in
    default (a helm built from Go modules claims v1.20 and fails the chart's constraint), and what it
    renders works on every version the chart allows.
    """
    text = (chart / "Chart.yaml").read_text()
    match = re.search(r'^kubeVersion:\s*"?>=\s*v?(\d+\.\d+\.\d+)', text, re.M)
    if not match:
        raise HelmError(f'{chart}/Chart.yaml: kubeVersion must be a minimum, e.g. ">=1.30.0-0"')
    return match.group(1)


def run(
    args: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, env: dict[str, str] | None = None
) -> str:
    """Run `helm ARGS...`, return stdout; raise HelmError with helm's own message on failure."""
    cmd = [helm_binary(), *args]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired as exc:
        raise HelmError(f"`{' '.join(cmd)}` did not finish within {timeout_s:.0f}s") from exc
    if proc.returncode != 0:
        raise HelmError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
    return proc.stdout


def template(
    chart: Path,
    *,
    release: str = "kvferry",
    namespace: str = "kvferry-system",
    values: Sequence[Path] = (),
    set_values: Sequence[str] = (),
    show_only: Sequence[str] = (),
) -> str:
    """`helm template` the chart offline, as the oldest Kubernetes version it supports."""
    args = ["template", release, str(chart), "--namespace", namespace, "--kube-version", kube_version(chart)]
    for path in values:
        args += ["--values", str(path)]
    for item in set_values:
        args += ["--set", item]
    for path in show_only:
        args += ["--show-only", path]
    return run(args)


def lint(chart: Path, *, values: Sequence[Path] = ()) -> str:
    """`helm lint --strict` the chart; raises HelmError on any warning or error."""
    args = ["lint", str(chart), "--strict", "--kube-version", kube_version(chart)]
    for path in values:
        args += ["--values", str(path)]
    return run(args)
