"""Two status writers never leave an older workload's readiness in status (the lost-update race).

The reconcile summarizes its apply responses; the refresh summarizes watch events. Whichever writes
last must not write readiness older than what the watch has already seen.
"""

from __future__ import annotations

from typing import Any

from kvferry.operator.reconcile.apply import KubeError
from kvferry.operator.spec import names
from kvferry.operator.status.conditions import ConditionType, Observed, condition, summarize
from kvferry.operator.status.publish import freshest, newer, write_observed_status


def _sts(rv: str, ready: int) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1, "resourceVersion": rv},
        "spec": {"replicas": 1, "template": {"metadata": {"labels": {names.LABEL_REVISION: "r1"}}}},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": ready, "updatedReplicas": 1},
    }


def _router(rv: str) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1, "resourceVersion": rv},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
    }


class StatusStore:
    """The CR's status subresource with optimistic concurrency, as the API server keeps it."""

    def __init__(self) -> None:
        self.cr: dict[str, Any] = {"metadata": {"namespace": "ns", "name": "x", "resourceVersion": "1"}}
        self.writes = 0
        self.before_write: list = []  # callables run before a patch lands (another writer, a watch event)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return {**self.cr, "metadata": dict(self.cr["metadata"])}

    def patch_status(self, namespace: str, name: str, patch: dict, resource_version: str | None) -> dict:
        while self.before_write:
            self.before_write.pop(0)()
        if resource_version != self.cr["metadata"]["resourceVersion"]:
            raise KubeError(409, "conflict")
        self.writes += 1
        rv = str(int(self.cr["metadata"]["resourceVersion"]) + 1)
        self.cr = {"metadata": {**self.cr["metadata"], "resourceVersion": rv}, "status": patch}
        return self.cr


def _summary(prev: dict[str, Any], seen: Observed) -> dict[str, Any]:
    return summarize(
        seen,
        cr_name="x",
        namespace="ns",
        generation=1,
        revision="r1",
        desired={"prefill": 1, "decode": 1},
        router_replicas=1,
        previous=prev,
        now="t",
    )


def _ready(store: StatusStore) -> str:
    return condition(store.cr["status"], ConditionType.READY)["status"]


def test_newer_prefers_the_higher_resource_version_and_keeps_the_first_otherwise() -> None:
    a, b = _sts("9", 0), _sts("10", 1)
    assert newer(a, b) is b and newer(b, a) is b  # numeric, not string, order
    assert newer(a, None) is a and newer(None, b) is b
    assert newer(_sts("x1", 0), _sts("x2", 1))["metadata"]["resourceVersion"] == "x1"


def test_freshest_takes_each_workload_from_whichever_copy_is_newer() -> None:
    applied = Observed({"prefill": _sts("5", 0), "decode": _sts("8", 0)}, _router("3"))
    watched = {"prefill": _sts("7", 1), "decode": _sts("6", 1), "router": None}
    seen = freshest(applied, watched.get)
    assert seen.statefulsets["prefill"]["metadata"]["resourceVersion"] == "7"
    assert seen.statefulsets["decode"]["metadata"]["resourceVersion"] == "8"
    assert seen.router is applied.router


def test_reconcile_writing_last_keeps_readiness_the_watch_saw_first() -> None:
    # The reconcile applied before the pods were ready; the watch saw them ready before it wrote.
    store = StatusStore()
    applied = Observed({"prefill": _sts("5", 0), "decode": _sts("6", 0)}, _router("4"))
    watched = {"prefill": _sts("9", 1), "decode": _sts("10", 1), "router": _router("4")}
    write_observed_status(store, store.get("", "", ""), applied, watched.get, _summary)
    assert _ready(store) == "True"


def test_an_event_that_lands_while_the_reconcile_writes_is_written_too() -> None:
    # The pods become ready after the reconcile computed its status but before its write: the refresh
    # of that event ran before the CR had status and skipped, so the reconcile must write again.
    store = StatusStore()
    applied = Observed({"prefill": _sts("5", 1), "decode": _sts("6", 0)}, _router("4"))
    watched: dict[str, Any] = {"prefill": None, "decode": None, "router": None}
    store.before_write.append(lambda: watched.update(decode=_sts("11", 1)))
    write_observed_status(store, store.get("", "", ""), applied, watched.get, _summary)
    assert _ready(store) == "True" and store.writes == 2


def test_a_conflicting_writer_makes_the_retry_use_the_new_status_and_newest_workloads() -> None:
    store = StatusStore()
    applied = Observed({"prefill": _sts("5", 0), "decode": _sts("6", 0)}, _router("4"))
    watched: dict[str, Any] = {"prefill": None, "decode": None, "router": None}

    def refresh_wins() -> None:  # the refresh of "pods ready" writes first
        watched.update(prefill=_sts("9", 1), decode=_sts("10", 1))
        store.cr = {"metadata": {**store.cr["metadata"], "resourceVersion": "2"}, "status": {"by": "refresh"}}

    store.before_write.append(refresh_wins)
    write_observed_status(store, store.get("", "", ""), applied, watched.get, _summary)
    assert _ready(store) == "True" and store.writes == 1
