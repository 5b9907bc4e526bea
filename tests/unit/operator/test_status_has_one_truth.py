"""Every status writer (reconcile, workload refresh, metrics timer) publishes the same conditions from the
same observations: one tick of the metrics timer never clears a fault only the reconcile can see, and a
refresh never turns an apply failure back into Ready. Degraded follows one order:
InvalidSpec > ApplyFailed > Conflict > SecretMissing > TransferUnhealthy."""

from __future__ import annotations

import copy
from typing import Any

from kvferry.operator.reconcile import steps
from kvferry.operator.reconcile.apply import KubeError
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import Inference, names
from kvferry.operator.status import scrape
from kvferry.operator.status.conditions import DEGRADED_ORDER, ConditionType, Reason, condition

from tests.unit.operator.cases import make_inference


def _metrics(transfers: int, failures: int) -> str:
    return (
        f'kvferry_transfers_total{{backend="UCX"}} {transfers}\n'
        f'kvferry_transfer_failures_total{{reason="deadline"}} {failures}\n'
    )


class FakeKube:
    """Just enough of the API for reconcile/refresh/scrape: objects by (kind, name), a status subresource
    with optimistic concurrency, workloads that report themselves ready."""

    def __init__(self, cr: dict[str, Any]) -> None:
        self.cr, self.objects, self.rv = cr, {}, 10
        self.secrets: set[str] = set()
        self.fail_kind = ""
        self.history: list[dict[str, tuple[str, str]]] = []

    def _bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind == "DisaggregatedInference":
            return copy.deepcopy(self.cr)
        return copy.deepcopy(self.objects.get((kind, name)))

    def exists(self, kind: str, namespace: str, name: str) -> bool:
        return name in self.secrets

    def create_owned(self, obj: dict[str, Any], owner_uid: str) -> bool:  # the transfer token
        self.secrets.add(obj["metadata"]["name"])
        return True

    def serves(self, group: str) -> bool:
        return False  # no gang admission API (Kueue, coscheduling) installed

    def list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        return [
            {
                "metadata": {
                    "name": f"{names.role_name('x', role)}-0",
                    "namespace": namespace,
                    "labels": {names.LABEL_ROLE: role},
                    "ownerReferences": [
                        # uid: the one apply() gives every stored object (the StatefulSet's here)
                        {
                            "kind": "StatefulSet",
                            "name": names.role_name("x", role),
                            "uid": "u",
                            "controller": True,
                        }
                    ],
                },
                "status": {"phase": "Running", "podIP": "10.0.0.1"},
            }
            for role in names.ROLES
        ]

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == self.fail_kind:
            raise KubeError(500, f"apply {obj['kind']}: etcd timeout")
        stored = copy.deepcopy(obj)
        stored["metadata"] |= {"resourceVersion": self._bump(), "generation": 1, "uid": "u"}
        if obj["kind"] in ("StatefulSet", "Deployment"):
            n = obj["spec"].get("replicas", 1)
            stored["status"] = {
                "observedGeneration": 1,
                "replicas": n,
                "readyReplicas": n,
                "updatedReplicas": n,
                "currentRevision": "a",
                "updateRevision": "a",
            }
        self.objects[(obj["kind"], obj["metadata"]["name"])] = stored
        return copy.deepcopy(stored)

    def patch_status(self, namespace: str, name: str, patch: dict, resource_version: str | None) -> dict:
        if resource_version != self.cr["metadata"]["resourceVersion"]:
            raise KubeError(409, "conflict")
        self.cr["status"] = {**(self.cr.get("status") or {}), **copy.deepcopy(patch)}
        self.cr["metadata"]["resourceVersion"] = self._bump()
        conds = {c["type"]: (c["status"], c["reason"]) for c in self.cr["status"]["conditions"]}
        self.history.append(conds)
        return self.cr

    def watched(self, role: str) -> dict[str, Any] | None:
        key = ("Deployment", names.router_name("x")) if role == "router" else ("StatefulSet", f"x-{role}")
        return copy.deepcopy(self.objects.get(key))

    # the three writers, as the handlers call them
    def reconcile(self) -> None:
        steps.reconcile(
            self, Inference.of(copy.deepcopy(self.cr)), CFG, trigger="resync", watched=self.watched
        )

    def refresh(self) -> None:
        steps.refresh_status(self, Inference.of(copy.deepcopy(self.cr)), self.watched)

    def tick(self, text: str) -> None:
        scrape.scrape(self, Inference.of(copy.deepcopy(self.cr)), CFG, lambda url: text, self.watched)

    def now(self, ctype: ConditionType) -> tuple[str, str]:
        c = condition(self.cr["status"], ctype) or {}
        return c.get("status", ""), c.get("reason", "")


CFG = OperatorConfig(transfer_source="pods")  # reads the fake pods; the router path: test_pool_status


def _kube() -> FakeKube:
    cr = make_inference("x", namespace="ns", modelToken={"name": "hf"}).obj()
    cr["metadata"] |= {"uid": "cr-uid", "generation": 1, "resourceVersion": "1"}
    return FakeKube(cr)


def test_a_metrics_tick_keeps_a_missing_secret_and_precedence_holds() -> None:
    kube = _kube()
    kube.reconcile()
    assert kube.now(ConditionType.DEGRADED) == ("True", "SecretMissing")
    kube.tick(_metrics(10, 0))  # healthy transfers: must not clear what only the reconcile sees
    assert kube.now(ConditionType.TRANSFER_HEALTHY) == ("True", "TransfersSucceeding")
    assert kube.now(ConditionType.DEGRADED) == ("True", "SecretMissing")
    kube.refresh()
    kube.tick(_metrics(20, 3))  # unhealthy transfers rank below a missing Secret
    assert kube.now(ConditionType.TRANSFER_HEALTHY)[0] == "False"
    assert kube.now(ConditionType.DEGRADED) == ("True", "SecretMissing")
    kube.refresh()
    kube.secrets.add("hf")
    kube.reconcile()  # the Secret appeared: the next fault in line shows
    assert kube.now(ConditionType.DEGRADED) == ("True", "TransferUnhealthy")
    kube.tick(_metrics(30, 3))  # no new failures: healthy, nothing left
    assert kube.now(ConditionType.DEGRADED) == ("False", "Reconciled")
    assert _no_flaps(kube.history), kube.history


def test_refresh_and_tick_keep_an_apply_failure_not_ready() -> None:
    kube = _kube()
    kube.secrets.add("hf")
    kube.reconcile()
    assert kube.now(ConditionType.READY) == ("True", "AllReplicasReady")
    kube.fail_kind = "ConfigMap"
    kube.reconcile()
    for writer in (kube.refresh, lambda: kube.tick(_metrics(10, 0)), kube.refresh):
        writer()
        assert kube.now(ConditionType.READY) == ("False", "ApplyFailed")
        assert kube.now(ConditionType.DEGRADED) == ("True", "ApplyFailed")
    kube.fail_kind = ""
    kube.reconcile()
    assert kube.now(ConditionType.READY) == ("True", "AllReplicasReady")


def test_degraded_order_is_the_documented_one() -> None:
    assert [r.value for r in DEGRADED_ORDER] == [
        Reason.INVALID_SPEC.value,
        "ApplyFailed",
        "Conflict",
        "SecretMissing",
        "TransferUnhealthy",
    ]


def _no_flaps(history: list[dict[str, tuple[str, str]]]) -> bool:
    """No condition returns to a value it left unless something in between changed it for a reason:
    here each writer runs once per step, so A -> B -> A within three consecutive writes is a flap."""
    for ctype in {t for h in history for t in h}:
        seq = [h.get(ctype) for h in history]
        if any(a == c and a != b for a, b, c in zip(seq, seq[1:], seq[2:], strict=False)):
            return False
    return True
