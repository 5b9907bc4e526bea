"""Entry step: `python -m kvferry.local.nodeagent --kubeconfig K --node cpu-0` runs until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from kvferry.local.nodeagent.agent import NodeAgent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.local.nodeagent", description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", required=True, help="an existing Node that kwok does not manage")
    parser.add_argument("--pod-cidr", default="10.213.0.0/24", help="private subnet for pod IPs (node netns)")
    parser.add_argument(
        "--workdir", default=None, help="pod volumes and container logs (default: a temp dir)"
    )
    parser.add_argument(
        "--cores", default=None, help="cores for whole-CPU containers, e.g. 0,1 (default: all)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cores = [int(c) for c in args.cores.split(",")] if args.cores else None
    agent = NodeAgent(args.kubeconfig, args.node, args.pod_cidr, args.workdir, cores)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    agent.start()
    done.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
