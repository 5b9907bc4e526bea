"""Kube.apply writes only over what it observed as the object's controller's: every apply carries the
resourceVersion of its read (the object's, or the collection's when the name was free), a 409 that is
not a field-manager conflict means the name changed and is read and judged again, and a field-manager
conflict is forced without dropping that precondition. The real API server's side of this is in
tests/cluster/test_operator_takes_over_nothing.py."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.operator.reconcile.apply import APPLY_ATTEMPTS, Kube, KubeError, NotControlled

OURS = {"apiVersion": "kvferry.io/v1alpha1", "kind": "DisaggregatedInference", "name": "x", "uid": "cr"}
FIELD_CONFLICT = {"details": {"causes": [{"reason": "FieldManagerConflict"}]}}


def _obj(owner: dict[str, Any] | None = OURS) -> dict[str, Any]:
    refs = [{**owner, "controller": True}] if owner else []
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "ns", "ownerReferences": refs},
    }


class Server:
    """One name on a fake API server: `held` is what holds it (None: free); `script` answers applies."""

    def __init__(self, held: dict[str, Any] | None, script: list[tuple[int, dict[str, Any]]]):
        self.held, self.script, self.rv = held, list(script), 7
        self.sent: list[tuple[str, dict[str, str], str]] = []  # (method, query, resourceVersion sent)
        self.between: list[Any] = []  # run before the next PATCH: another writer racing us

    def call(self, method: str, kind: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
        body = kw.get("body") or {}
        self.sent.append((method, kw.get("query") or {}, body.get("metadata", {}).get("resourceVersion", "")))
        if method == "GET":
            items = (
                [{**self.held, "metadata": {**self.held["metadata"], "resourceVersion": "5"}}]
                if self.held
                else []
            )
            return 200, {"metadata": {"resourceVersion": str(self.rv)}, "items": items}
        while self.between:
            self.between.pop(0)()
        return self.script.pop(0) if self.script else (200, body)


def _kube(server: Server) -> Kube:
    kube = Kube(api=None)  # type: ignore[arg-type]
    kube._call = server.call  # type: ignore[method-assign]
    return kube


def test_a_free_name_is_applied_on_the_collection_version_of_the_read() -> None:
    server = Server(None, [])
    _kube(server).apply(_obj())
    assert [(m, rv) for m, _, rv in server.sent] == [("GET", ""), ("PATCH", "7")]


def test_a_field_conflict_is_forced_on_the_same_precondition() -> None:
    server = Server(_obj(), [(409, FIELD_CONFLICT), (200, {"ok": 1})])
    assert _kube(server).apply(_obj()) == {"ok": 1}
    patches = [(q.get("force"), rv) for m, q, rv in server.sent if m == "PATCH"]
    assert patches == [(None, "5"), ("true", "5")]


def test_a_name_taken_between_read_and_apply_is_read_again_and_left_alone() -> None:
    server = Server(None, [(409, {"reason": "Conflict"})])
    server.between.append(lambda: setattr(server, "held", _obj(owner=None)))
    with pytest.raises(NotControlled, match="ConfigMap c exists and is not this DisaggregatedInference's"):
        _kube(server).apply(_obj())
    assert [m for m, _, _ in server.sent] == ["GET", "PATCH", "GET"]  # the one PATCH was refused


def test_an_object_that_keeps_changing_is_given_up_on() -> None:
    server = Server(_obj(), [(409, {"reason": "Conflict"})] * APPLY_ATTEMPTS)
    with pytest.raises(KubeError, match="kept changing") as err:
        _kube(server).apply(_obj())
    assert not isinstance(err.value, NotControlled)
    assert [m for m, _, _ in server.sent].count("PATCH") == APPLY_ATTEMPTS
