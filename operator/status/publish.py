"""Publish step: the one status writer. Every trigger hands in what it observed; status.summarize turns
all observations into the whole status (one precedence for every condition) and this writes it.

Three triggers observe: the reconcile (render, Secrets, apply: the faults), the refresh on each workload
watch event (workloads), the metrics timer (transfer health). What a trigger did not observe is carried
from the status it builds on, so no trigger can overwrite another's finding with a guess.
Writes are optimistic (the CR's resourceVersion): on a conflict the status is recomputed from what the
other writer wrote, and a writer whose watched workloads moved on during its write writes again.
`publish` takes the CR as parsed at the edge (spec.Inference); `write_status` works on its body, the copy
whose resourceVersion the patch is conditional on, and on the fresh bodies a conflict makes it read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvferry.operator.fleet.packed import pack, unpack
from kvferry.operator.reconcile.apply import Kube, KubeError, now_iso
from kvferry.operator.spec import Inference, names
from kvferry.operator.status import conditions as status
from kvferry.operator.status.conditions import Observed, Verdict

# role ("prefill"/"decode"/"router") -> the operator's last watched copy of that workload, or None.
Watched = Callable[[str], dict[str, Any] | None]
REOBSERVE_ROUNDS = 3


def no_watch(_role: str) -> dict[str, Any] | None:
    return None


def desired_replicas(
    cr: Inference,
    sts: dict[str, dict[str, Any] | None] | None = None,
    previous: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Replicas each role should have: the spec's, or the StatefulSet's own where an autoscaler owns them.

    An invalid spec has no replicas to trust: each role keeps the desired count its status (`previous`,
    else the CR's) last showed.
    """
    sts, shown = sts or {}, cr.status if previous is None else previous
    out = {}
    for role in names.ROLES:
        if not cr.valid:
            out[role] = int((shown.get(role) or {}).get("desired", 1))
            continue
        rspec = getattr(cr.spec, role)
        current = (sts.get(role) or {}).get("spec", {}).get("replicas")
        autoscaled = rspec.replicas_owner == "autoscaler" and current is not None
        out[role] = int(current if autoscaled else rspec.replicas)
    return out


STATUS_ATTEMPTS = 4
# The CR as our last status write stored it is kept on the client (`Kube.written`, by namespace/name):
# a writer whose copy came from the watch (which lags behind our own writes) starts from it instead of
# drawing a 409 and a read.
WRITTEN_MAX = 10_000
_written_lock = threading.Lock()


def _last_written(kube: Kube, key: tuple[str, str]) -> dict[str, Any] | None:
    written = getattr(kube, "written", None)
    if written is None:
        return None
    with _written_lock:
        found: bytes | None = written.get(key)
    return unpack(found)


def _remember(kube: Kube, key: tuple[str, str], stored: Any) -> None:
    written = getattr(kube, "written", None)
    if written is None or not isinstance(stored, dict):
        return
    if not (stored.get("metadata") or {}).get("resourceVersion"):
        return
    with _written_lock:
        written.pop(key, None)
        kept = {k: stored[k] for k in ("metadata", "spec", "status") if k in stored}
        # managedFields are never read from it and, after a few writers, most of a CR's size.
        kept["metadata"] = {k: v for k, v in stored["metadata"].items() if k != "managedFields"}
        written[key] = pack(kept)  # packed: a parsed CR is ~10x its text (memory per CR)
        while len(written) > WRITTEN_MAX:  # bounded: the oldest entries go first
            del written[next(iter(written))]


def write_status(
    kube: Kube, cr: dict[str, Any], compute: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """Patch status with `compute(previous_status)`, only if it changes anything, optimistically.

    The patch carries the CR's resourceVersion; on a conflict (the other status writer got there first)
    the CR is read again and the patch recomputed from what is there now, so neither writer clobbers
    the other's conditions with a stale copy. Returns the patch written (or that needed no write).
    """
    meta = cr["metadata"]
    key = (meta["namespace"], meta["name"])
    cr = newer(cr, _last_written(kube, key)) or cr  # our last write may be newer than the caller's copy
    for _ in range(STATUS_ATTEMPTS):
        previous = cr.get("status") or {}
        patch = compute(previous)
        if all(previous.get(k) == v for k, v in patch.items()):
            return patch
        try:
            stored = kube.patch_status(*key, patch, cr["metadata"].get("resourceVersion"))
            _remember(kube, key, stored)
            return patch
        except KubeError as exc:
            if exc.status != 409:
                raise
        fresh = kube.get("DisaggregatedInference", meta["namespace"], meta["name"])
        if fresh is None:
            return patch  # deleted meanwhile
        cr = fresh
    raise KubeError(409, f"status of {meta['namespace']}/{meta['name']} kept changing under us")


def newer(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The later of two copies of one object: `b` only if its resourceVersion is provably higher.

    Within one API server resourceVersions are etcd revisions (integers that only grow; comparable
    by contract since Kubernetes 1.35's ComparableResourceVersion); anything else keeps `a`.
    """
    if a is None or b is None:
        return a if b is None else b
    ra, rb = (str(o["metadata"].get("resourceVersion", "")) for o in (a, b))
    return b if ra.isdigit() and rb.isdigit() and int(rb) > int(ra) else a


def freshest(observed: Observed, watched: Watched) -> Observed:
    """`observed` with each workload replaced by the watch's copy where that one is newer."""
    return replace(
        observed,
        statefulsets={r: newer(observed.statefulsets.get(r), watched(r)) for r in names.ROLES},
        router=newer(observed.router, watched("router")),
    )


def _versions(observed: Observed) -> list[str | None]:
    objs = [*(observed.statefulsets.get(r) for r in names.ROLES), observed.router]
    return [o["metadata"].get("resourceVersion") if o else None for o in objs]


def write_observed_status(
    kube: Kube,
    cr: dict[str, Any],
    observed: Observed,
    watched: Watched,
    summarize: Callable[[dict[str, Any], Observed], dict[str, Any]],
) -> dict[str, Any]:
    """write_status from the newest workloads known, again if the watch moved on while writing.

    Two writers summarize workloads into status: a reconcile (from its apply responses) and the
    refresh on each workload event. Without this a reconcile that started before a pod became ready
    could write last and leave "0/1 ready" until the next resync: the refresh of that event may have
    run before the reconcile's write, or skipped because the CR had no status yet. The watch updates
    its copies before it runs handlers, so re-checking them after the write closes that window.
    """
    used: list[Observed] = []

    def compute(prev: dict[str, Any]) -> dict[str, Any]:
        used.append(freshest(observed, watched))
        return summarize(prev, used[-1])

    meta = cr["metadata"]
    patch = write_status(kube, cr, compute)
    for _ in range(REOBSERVE_ROUNDS):
        if _versions(freshest(observed, watched)) == _versions(used[-1]):
            break
        fresh = kube.get("DisaggregatedInference", meta["namespace"], meta["name"])
        if fresh is None:
            break
        patch = write_status(kube, fresh, compute)
    return patch


# (previous transfer summary) -> (new summary, TransferHealthy verdict): the metrics timer's finding,
# computed inside the write so a retry after a conflict builds on the summary the other writer left.
TransferFinding = Callable[[dict[str, Any]], tuple[dict[str, Any], Verdict]]


def publish(
    kube: Kube,
    cr: Inference,
    observed: Observed,
    watched: Watched,
    *,
    generation: int | None = None,
    revision: str | None = None,
    transfer: TransferFinding | None = None,
) -> dict[str, Any]:
    """Write the CR's whole status from `observed` (+ the watch's newer workloads); returns the patch.

    generation/revision: the reconcile's (None: keep the status's own, for refresh and timer).
    """
    meta = cr.meta
    router_replicas = cr.spec.router.replicas if cr.valid else 1

    def compute(prev: dict[str, Any], seen: Observed) -> dict[str, Any]:
        if transfer is not None:
            summary, verdict = transfer(prev.get("transfer") or {})
            seen = replace(seen, transfer=verdict, transfer_summary=summary)
        return status.summarize(
            seen,
            cr_name=meta.name,
            namespace=meta.namespace,
            generation=prev.get("observedGeneration", 0) if generation is None else generation,
            revision=prev.get("revision", "") if revision is None else revision,
            desired=desired_replicas(cr, seen.statefulsets, prev),
            router_replicas=router_replicas,
            previous=prev,
            now=now_iso(),
        )

    return write_observed_status(kube, cr.body, observed, watched, compute)
