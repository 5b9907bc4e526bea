"""`kvferry cluster build|up|down|env`: build the control-plane binaries, start/stop a plane by hand.

`up` starts the plane detached (components run in their own sessions) and records PIDs in the workdir;
`down` stops them by PID; `env` prints shell exports for kubectl/helm against it.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from kvferry.local.controlplane import build, nodes, versions
from kvferry.local.controlplane.plane import STATE_FILE, ControlPlane, ControlPlaneError

ENV_KEYS = ("KUBECONFIG", "PATH", "HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")


def default_workdir() -> Path:
    return build.cache_dir() / "planes" / "default"


def parse_counts(text: str) -> dict[str, int]:
    """'p5en=2,trn2=1,cpu=1' -> {'p5en': 2, ...}; the error names the bad part."""
    counts: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, n = part.partition("=")
        if not sep or not n.isdigit():
            raise ValueError(f"--nodes: expected shape=count, got {part!r}")
        nodes.shape(key)
        counts[key] = int(n)
    return counts


def _cmd_build(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    extra = tuple(c for c in build.ON_DEMAND if c.name in (args.with_ or []))
    times = build.ensure_built(extra=extra)
    pins = (
        f"kubernetes {versions.KUBERNETES}, etcd {versions.ETCD}, kwok {versions.KWOK}, helm {versions.HELM}"
    )
    state = "built" if times else "cached"
    print(f"{state} in {time.monotonic() - t0:.0f} s: {pins} -> {build.bin_dir()}")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir)
    if (workdir / STATE_FILE).exists():
        old = ControlPlane.attach(workdir)
        if any(p.alive() for p in old.procs.values()):
            print(
                f"a control plane is already running in {workdir}; run `kvferry cluster down` first",
                file=sys.stderr,
            )
            return 1
    t0 = time.monotonic()
    counts, detached = parse_counts(args.nodes), not args.foreground
    plane = ControlPlane(counts, kwok_cpu=not args.cpu_agent, detached=detached).start(workdir)
    took = time.monotonic() - t0
    print(
        f"# control plane up in {took:.1f} s at {plane.server} (cumulative: {plane.timings})", file=sys.stderr
    )
    _print_env(plane)
    if args.foreground:
        print("# Ctrl-C stops it", file=sys.stderr)
        try:
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            plane.stop()
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    plane = ControlPlane.attach(Path(args.workdir))
    plane.stop()
    (Path(args.workdir) / STATE_FILE).unlink(missing_ok=True)
    print(f"stopped the control plane in {args.workdir}", file=sys.stderr)
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    _print_env(ControlPlane.attach(Path(args.workdir)))
    return 0


def _print_env(plane: ControlPlane) -> None:
    env = plane.env()
    for key in ENV_KEYS:
        print(f"export {key}={shlex.quote(env[key])}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvferry cluster", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the pinned binaries into $KVFERRY_BIN (cached)")
    b.add_argument(
        "--with",
        dest="with_",
        action="append",
        choices=[c.name for c in build.ON_DEMAND],
        help="also build an on-demand component (kueue: ~15 min cold; the kueue tests need it)",
    )
    up = sub.add_parser("up", help="start a control plane with fake nodes")
    up.add_argument(
        "--nodes", default="p5en=2,trn2=1,cpu=1", help="fake nodes, shape=count,... (default: %(default)s)"
    )
    up.add_argument("--cpu-agent", action="store_true", help="leave the cpu nodes to another agent, not kwok")
    up.add_argument("--foreground", action="store_true", help="stay attached; stop the plane on Ctrl-C")
    for name, help_ in (("down", "stop the plane started by `up`"), ("env", "print shell exports for it")):
        sub.add_parser(name, help=help_)
    for action in sub.choices.values():
        action.add_argument(
            "--workdir", default=str(default_workdir()), help="plane state dir (default: %(default)s)"
        )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"build": _cmd_build, "up": _cmd_up, "down": _cmd_down, "env": _cmd_env}[args.cmd]
    try:
        return handler(args)
    except (ControlPlaneError, build.BuildError, ValueError) as e:
        print(f"kvferry cluster {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
