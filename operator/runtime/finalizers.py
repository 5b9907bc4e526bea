"""`kvferry release-finalizers`: delete DisaggregatedInferences when the operator is gone.

kopf puts a finalizer (`kvferry.io/finalizer`) on every CR because each CR has timers (metrics scrape
and resync): without it a deleted CR's timers would keep running. It holds a CR's deletion until the
operator removes it, so with the operator uninstalled a CR (and its namespace) stays Terminating.
This command removes only that finalizer (and kopf's default one, should an operator have run with
default settings), by default only from CRs already being deleted, and refuses while an operator
Deployment is ready in the cluster. See docs/operator.md and docs/troubleshooting.md.

The running operator uses `stale`/`release_stale` on the CRs it serves: the finalizers a shard layout
other than its own left behind (`operator.shards` changed), removed once the CR is being deleted.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kvferry.operator.spec import GROUP, PLURAL, VERSION, names

if TYPE_CHECKING:
    from kvferry.operator.reconcile.apply import Kube

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
    from kvferry.operator.reconcile.apply import KubeError

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
OPERATOR_SELECTOR = f"{names.LABEL_COMPONENT}=operator,app.kubernetes.io/part-of=kvferry"
REQUEST_TIMEOUT_S = 30.0


class OperatorRunning(RuntimeError):
    """An operator Deployment is still ready: it will remove the finalizers itself."""


def running_operators(api: Any) -> list[str]:
    """`namespace/name` of every operator Deployment with at least one ready replica."""
    from kubernetes import client

    deps = client.AppsV1Api(api).list_deployment_for_all_namespaces(
        label_selector=OPERATOR_SELECTOR, _request_timeout=REQUEST_TIMEOUT_S
    )
    return [
        f"{d.metadata.namespace}/{d.metadata.name}"
        for d in deps.items
        if d.status and (d.status.ready_replicas or 0) > 0
    ]


def release(api: Any, namespace: str | None = None, *, force: bool = False) -> list[str]:
    """Remove the operator's finalizers from DisaggregatedInferences in `namespace` (None: all).

    Only CRs with a deletionTimestamp unless `force`; raises OperatorRunning if an operator Deployment
    is ready, unless `force`. Returns `namespace/name` of each CR released.
    """
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    if not force:
        running = running_operators(api)
        if running:
            raise OperatorRunning(", ".join(running))
    custom = client.CustomObjectsApi(api)
    try:
        if namespace is None:
            items = custom.list_cluster_custom_object(
                GROUP, VERSION, PLURAL, _request_timeout=REQUEST_TIMEOUT_S
            )["items"]
        else:
            items = custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, _request_timeout=REQUEST_TIMEOUT_S
            )["items"]
    except ApiException as e:
        if e.status == 404:  # the CRD is not installed: nothing to release
            return []
        raise
    released = []
    for item in items:
        meta = item["metadata"]
        if not force and not meta.get("deletionTimestamp"):
            continue
        if _release_one(custom, item):
            released.append(f"{meta['namespace']}/{meta['name']}")
    return released


def _release_one(custom: Any, item: dict[str, Any], attempts: int = 5) -> bool:
    """Remove our finalizers from one CR; True if any were removed. Re-reads on a conflict."""
    from kubernetes.client.rest import ApiException

    meta = item["metadata"]
    ns, name = meta["namespace"], meta["name"]
    for _ in range(attempts):
        present = meta.get("finalizers") or []
        if not any(ours(f) for f in present):
            return False
        keep = [f for f in present if not ours(f)]
        # resourceVersion makes the merge patch conditional: a concurrent change fails with 409.
        patch = {"metadata": {"finalizers": keep or None, "resourceVersion": meta["resourceVersion"]}}
        try:
            custom.patch_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name, patch, _request_timeout=REQUEST_TIMEOUT_S
            )
            return True
        except ApiException as e:
            if e.status == 404:  # deleted meanwhile
                return False
            if e.status != 409:
                raise
        try:
            meta = custom.get_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name, _request_timeout=REQUEST_TIMEOUT_S
            )["metadata"]
        except ApiException as e:
            if e.status == 404:
                return False
            raise
    raise RuntimeError(f"{ns}/{name}: finalizers changed under us {attempts} times")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry release-finalizers", description=__doc__.splitlines()[0])
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", help="only CRs in this namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="CRs in every namespace")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: KUBECONFIG, ~/.kube/config)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="also CRs not being deleted, and even while an operator Deployment is ready",
    )
    args = parser.parse_args(argv)
    from kubernetes import config
    from kubernetes.client.rest import ApiException

    try:
        api = config.new_client_from_config(config_file=args.kubeconfig)
    except Exception as exc:  # noqa: BLE001 - config errors come as several types
        print(f"kvferry release-finalizers: cannot load kubeconfig: {exc}", file=sys.stderr)
        return 2
    with api:
        try:
            released = release(api, None if args.all_namespaces else args.namespace, force=args.force)
        except OperatorRunning as exc:
            print(
                f"kvferry release-finalizers: the operator is running ({exc}); it removes its finalizer "
                "itself. Uninstall or scale it to 0 first, or pass --force.",
                file=sys.stderr,
            )
            return 2
        except ApiException as exc:
            print(f"kvferry release-finalizers: API error {exc.status}: {exc.reason}", file=sys.stderr)
            return 1
    for name in released:
        print(f"released {name}")
    if not released:
        print("nothing to release")
    return 0
