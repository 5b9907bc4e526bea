"""`kvferry release-finalizers`: delete DisaggregatedInferences when the operator is gone.

kopf puts a finalizer (`kvferry.io/finalizer`) on every CR because each CR has timers (metrics scrape
and resync): without it a deleted CR's timers would keep running. It holds a CR's deletion until the
operator removes it, so with the operator uninstalled a CR (and its namespace) stays Terminating.
This command removes only that finalizer (and kopf's default one, should an operator have run with
default settings), by default only from CRs already being deleted, and refuses while an operator
Deployment is ready in the cluster. See docs/operator.md and docs/troubleshooting.md.

The running operator uses `stale`/`release_stale` on the CRs it serves: the finalizers a shard layout
other than its own left behind (`operator.shards` changed), removed once the CR is being deleted.
Both read and write through the operator's one client (`Kube`): a finalizer write goes through its
ownership gate, conditional on the CR as read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvferry.operator.reconcile.apply import Kube, KubeError
from kvferry.operator.spec import names

FINALIZERS = (f"{names.GROUP}/finalizer", "kopf.zalando.org/KopfFinalizerMarker")
SHARD_FINALIZER_PREFIX = f"{names.GROUP}/finalizer-shard-"  # sharded replicas' (handlers.shard_finalizer)


def ours(finalizer: str) -> bool:
    return finalizer in FINALIZERS or finalizer.startswith(SHARD_FINALIZER_PREFIX)


def stale(cr: dict[str, Any], current: str) -> list[str]:
    """The operator's finalizers on a CR being deleted other than `current` (this replica's), or [].

    kopf removes only its own finalizer name, and that name carries the shard layout
    (`kvferry.io/finalizer-shard-i-of-n`): after a change of operator.shards a CR keeps the old
    layout's name, which no running replica would ever remove, and its deletion (and its namespace's)
    would hang. Only once the CR is being deleted: while it lives, a replica of the old layout may
    still be running through the rollout and would put its finalizer back (no replica adds one to a
    CR being deleted: the API server refuses new finalizers then).
    """
    meta = cr.get("metadata") or {}
    if not meta.get("deletionTimestamp"):
        return []
    return [f for f in meta.get("finalizers") or [] if ours(f) and f != current]


def release_stale(kube: Kube, cr: dict[str, Any], current: str) -> list[str]:
    """Remove `stale(cr, current)` from the CR (through Kube.set_finalizers: the ownership gate,
    conditional on the CR as read); returns what was removed. A 409 (kopf removed its own meanwhile)
    or a 404 (deleted) is left to the next watch event, which reads the CR anew."""
    drop = stale(cr, current)
    if not drop:
        return []
    keep = [f for f in cr["metadata"].get("finalizers") or [] if f not in drop]
    try:
        kube.set_finalizers(cr, keep)
    except KubeError as exc:
        if exc.status not in (404, 409):
            raise
        return []
    return drop


# The chart's and manifests/install.yaml's operator Deployment carries both labels.
OPERATOR_LABELS = {names.LABEL_COMPONENT: "operator", "app.kubernetes.io/part-of": "kvferry"}
OPERATOR_SELECTOR = ",".join(f"{k}={v}" for k, v in OPERATOR_LABELS.items())
RELEASE_ATTEMPTS = 5  # reads + conditional writes of one CR's finalizers before giving up


class OperatorRunning(RuntimeError):
    """An operator Deployment is still ready: it will remove the finalizers itself."""


def running_operators(kube: Kube) -> list[str]:
    """`namespace/name` of every operator Deployment with at least one ready replica."""
    return [
        f"{d['metadata']['namespace']}/{d['metadata']['name']}"
        for d in kube.list("Deployment", None, OPERATOR_LABELS)
        if int((d.get("status") or {}).get("readyReplicas") or 0) > 0
    ]


def release(kube: Kube, namespace: str | None = None, *, force: bool = False) -> list[str]:
    """Remove the operator's finalizers from DisaggregatedInferences in `namespace` (None: all).

    Only CRs with a deletionTimestamp unless `force`; raises OperatorRunning if an operator Deployment
    is ready, unless `force`. Returns `namespace/name` of each CR released.
    """
    if not force:
        running = running_operators(kube)
        if running:
            raise OperatorRunning(", ".join(running))
    try:
        items = kube.list("DisaggregatedInference", namespace, {})
    except KubeError as exc:
        if exc.status == 404:  # the CRD is not installed: nothing to release
            return []
        raise
    released = []
    for item in items:
        meta = item["metadata"]
        if not force and not meta.get("deletionTimestamp"):
            continue
        if _release_one(kube, item):
            released.append(f"{meta['namespace']}/{meta['name']}")
    return released


def _release_one(kube: Kube, cr: dict[str, Any]) -> bool:
    """Remove our finalizers from one CR; True if any were removed. Through Kube.set_finalizers (the
    ownership gate, conditional on the CR as read): a concurrent change fails with 409 and the CR is
    read again."""
    meta = cr["metadata"]
    ns, name = meta["namespace"], meta["name"]
    for _ in range(RELEASE_ATTEMPTS):
        present = cr["metadata"].get("finalizers") or []
        if not any(ours(f) for f in present):
            return False
        try:
            kube.set_finalizers(cr, [f for f in present if not ours(f)])
            return True
        except KubeError as exc:
            if exc.status == 404:  # deleted meanwhile
                return False
            if exc.status != 409:
                raise
        fresh = kube.get("DisaggregatedInference", ns, name)
        if fresh is None:
            return False
        cr = fresh
    raise RuntimeError(f"{ns}/{name}: finalizers changed under us {RELEASE_ATTEMPTS} times")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry release-finalizers", description=__doc__.splitlines()[0])
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", help="only CRs in this namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="CRs in every namespace")
    parser.add_argument(
        "--kubeconfig",
        help="kubeconfig file (default: in a pod its service account, else KUBECONFIG, ~/.kube/config)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="also CRs not being deleted, and even while an operator Deployment is ready",
    )
    args = parser.parse_args(argv)
    try:
        kube = Kube.from_kubeconfig(args.kubeconfig)
    except Exception as exc:  # noqa: BLE001 - config errors come as several types
        print(f"kvferry release-finalizers: cannot load kubeconfig: {exc}", file=sys.stderr)
        return 2
    try:
        released = release(kube, None if args.all_namespaces else args.namespace, force=args.force)
    except OperatorRunning as exc:
        print(
            f"kvferry release-finalizers: the operator is running ({exc}); it removes its finalizer "
            "itself. Uninstall or scale it to 0 first, or pass --force.",
            file=sys.stderr,
        )
        return 2
    except KubeError as exc:
        print(f"kvferry release-finalizers: API error: {exc}", file=sys.stderr)
        return 1
    finally:
        kube.close()
    for name in released:
        print(f"released {name}")
    if not released:
        print("nothing to release")
    return 0
