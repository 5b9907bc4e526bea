"""Run step: `kvferry operator` parses flags/env into OperatorConfig and runs kopf with our handlers.

Cluster-wide by default; `--namespace` (repeatable) narrows it. More than one replica elects a leader
through kopf peering (`--peering`, crds/kopf-peerings.yaml); `--standalone` skips peering. `--shard i/n`
splits the CRs between n replicas (operator/runtime/shard.py), each electing its leader in its own peering.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import sys

import kopf
from kvferry.operator.runtime import handlers, lean
from kvferry.operator.runtime.config import OperatorConfig, check_shard, check_template


def parse(argv: list[str]) -> tuple[OperatorConfig, bool]:
    base = OperatorConfig.from_env()
    p = argparse.ArgumentParser(prog="kvferry operator", description=__doc__.splitlines()[0])
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    p.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    p.add_argument(
        "--kubeconfig", default=base.kubeconfig, help="kubeconfig file (default: in-cluster/KUBECONFIG)"
    )
    p.add_argument(
        "--standalone", action="store_true", default=base.standalone, help="no peering/leader election"
    )
    p.add_argument("--peering", default=base.peering, help="kopf peering name; required to exist when given")
    p.add_argument("--priority", type=int, default=base.priority, help="peering priority (0: random)")
    p.add_argument("--router-image", default=base.router_image)
    p.add_argument("--metrics-interval", type=float, default=base.metrics_interval)
    p.add_argument("--metrics-url", default=base.metrics_url, help="engine metrics URL template")
    p.add_argument("--resync-interval", type=float, default=base.resync_interval)
    p.add_argument("--liveness", default=base.liveness, help="host:port for /healthz")
    p.add_argument(
        "--shard", default=base.shard, help="serve shard i of n of the CRs (i/n, e.g. 0/2); default 0/1 = all"
    )
    p.add_argument(
        "--transfer-source",
        choices=("router", "pods"),
        default=base.transfer_source,
        help="read transfer metrics through each CR's router (one request per CR) or from every engine pod",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.namespaces and args.all_namespaces:
        p.error("--namespace and --all-namespaces are exclusive")
    try:
        check_template(args.metrics_url)
    except ValueError as exc:
        p.error(str(exc))
    try:
        check_shard(args.shard)
    except ValueError as exc:
        p.error(str(exc))
    for name in ("metrics_interval", "resync_interval"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    return dataclasses.replace(
        base,
        # Flags win over KVFERRY_NAMESPACES; with neither, the env value (or cluster-wide) stays.
        namespaces=() if args.all_namespaces else tuple(args.namespaces or base.namespaces),
        kubeconfig=args.kubeconfig,
        standalone=args.standalone,
        peering=args.peering,
        priority=args.priority or random.randint(1, 2**30),
        router_image=args.router_image,
        metrics_interval=args.metrics_interval,
        metrics_url=args.metrics_url,
        resync_interval=args.resync_interval,
        liveness=args.liveness,
        shard=args.shard,
        transfer_source=args.transfer_source,
    ), args.verbose


def main(argv: list[str] | None = None) -> int:
    cfg, verbose = parse(list(sys.argv[1:] if argv is None else argv))
    if cfg.kubeconfig:
        os.environ["KUBECONFIG"] = cfg.kubeconfig  # kopf's own login reads it too
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every request at INFO: one line per CR per metrics tick, noise at fleet scale.
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose else logging.WARNING)
    lean.install()  # watch events without managedFields: memory in a creation wave
    registry = kopf.OperatorRegistry()
    handlers.register(registry, cfg)
    settings = kopf.OperatorSettings()
    settings.peering.mandatory = bool(cfg.peering)
    settings.peering.name = cfg.peering_name
    settings.peering.priority = cfg.priority
    settings.peering.standalone = cfg.standalone
    kopf.run(
        registry=registry,
        settings=settings,
        standalone=cfg.standalone,
        clusterwide=not cfg.namespaces,
        namespaces=list(cfg.namespaces),
        liveness_endpoint=f"http://{cfg.liveness}/healthz" if cfg.liveness else None,
        memo=kopf.Memo(),
    )
    return 0
