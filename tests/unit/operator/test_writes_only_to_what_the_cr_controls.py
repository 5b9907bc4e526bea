"""The ownership gate (apply.not_controlled, Kube.write_owned): a write that is not an apply lands only on
the owner itself or on what its controller owner reference names by UID, never by name alone; a refused
write sends nothing. (The real API server: tests/cluster/test_operator_writes_only_its_own.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.operator.reconcile.apply import Kube, NotControlled, not_controlled, not_ours


def _obj(name: str, uid: str, owner_uid: str | None = None, kind: str = "StatefulSet") -> dict[str, Any]:
    refs = [{"kind": "DisaggregatedInference", "name": "db", "uid": owner_uid, "controller": True}]
    meta = {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": "7"}
    return {"kind": kind, "metadata": {**meta, **({"ownerReferences": refs} if owner_uid else {})}}


def test_only_the_owner_and_what_it_controls_by_uid_pass() -> None:
    assert not_controlled(_obj("db-prefill", "s1", owner_uid="cr-1"), "cr-1", "StatefulSet") is None
    assert not_controlled(_obj("db", "cr-1", kind="DisaggregatedInference"), "cr-1", "X") is None
    # another team's db-prefill, no owner; a same-named CR's (deleted and recreated: a new UID)
    why = not_controlled(_obj("db-prefill", "s2"), "cr-1", "StatefulSet")
    assert why == "StatefulSet db-prefill exists and is not the operator's (owner: no controller)"
    assert not_controlled(_obj("db-prefill", "s3", owner_uid="cr-0"), "cr-1", "StatefulSet")
    assert not_controlled(_obj("db-prefill", "s1", owner_uid="cr-1"), "", "StatefulSet")  # no UID: no
    # a non-controller reference with the right UID proves nothing either
    obj = _obj("db-prefill", "s4", owner_uid="cr-1")
    obj["metadata"]["ownerReferences"][0]["controller"] = False
    assert not_controlled(obj, "cr-1", "StatefulSet")
    rendered = _obj("db-prefill", "", owner_uid="cr-1")
    assert not_ours(_obj("db-prefill", "s2"), rendered) == (
        "StatefulSet db-prefill exists and is not this DisaggregatedInference's (owner: no controller)"
    )


class Recorded(Kube):
    """Kube with its transport recorded: only what would be sent is checked here."""

    def __init__(self) -> None:
        super().__init__(api=None)  # type: ignore[arg-type]
        self.sent: list[tuple[str, str, str, Any]] = []

    def _call(self, method: str, kind: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
        self.sent.append((method, kind, path, kw.get("body")))
        return 200, {}


def test_a_refused_write_sends_nothing_and_an_allowed_one_is_conditional() -> None:
    kube = Recorded()
    for write in (
        lambda: kube.scale(_obj("db-prefill", "s2"), "cr-1", 5),
        lambda: kube.patch_labels("Pod", _obj("db-prefill-0", "p1", kind="Pod"), "s1", {"a": "b"}),
        lambda: kube.set_finalizers(_obj("db", "", kind="DisaggregatedInference"), []),  # no UID read
    ):
        with pytest.raises(NotControlled):
            write()
    assert kube.sent == []
    kube.scale(_obj("db-prefill", "s1", owner_uid="cr-1"), "cr-1", 5)
    method, kind, path, body = kube.sent[0]
    assert (method, kind, path) == (
        "PATCH",
        "StatefulSet/scale",
        "/apis/apps/v1/namespaces/ns/statefulsets/db-prefill/scale",
    )
    assert body == {"spec": {"replicas": 5}, "metadata": {"resourceVersion": "7", "uid": "s1"}}
