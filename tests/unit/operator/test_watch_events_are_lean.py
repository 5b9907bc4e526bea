"""Watch events reach kopf's queues without managedFields (operator/runtime/lean.py, issue 19 memory).

kopf's own watch loop (`infinite_watch` -> `continuous_watch` -> listing and watch stream) runs here
with only its two API calls fed recorded answers: what comes out is what kopf's workers queue.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf
from kopf._cogs.clients import fetching, watching
from kopf._cogs.structs import references
from kvferry.operator.runtime import lean

MANAGED = [{"manager": "kvferry", "operation": "Apply", "fieldsV1": {"f:data": {"f:a": {}}}}]


def configmap(name: str, rv: str) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": rv}
    return {
        "kind": "ConfigMap",
        "metadata": meta | {"managedFields": copy.deepcopy(MANAGED)},
        "data": {"a": "1"},
    }


def run_kopf_watch(monkeypatch) -> list[Any]:
    async def fetch_objs(**_: Any):
        yield [configmap("listed", "5")], "5"

    async def watch_objs(**_: Any):
        yield {"type": "MODIFIED", "object": configmap("watched", "6")}
        yield {"type": "DELETED", "object": configmap("listed", "7")}

    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    monkeypatch.setattr(watching, "watch_objs", watch_objs)
    resource = references.Resource("", "v1", "configmaps", namespaced=True)
    settings = kopf.OperatorSettings()

    async def collect() -> list[Any]:
        out: list[Any] = []
        stream = watching.infinite_watch(settings=settings, resource=resource, namespace="ns", _iterations=1)
        async for event in stream:
            out.append(event)
            if len(out) == 4:  # listed, LISTED bookmark, the two watched events
                break
        return out

    return asyncio.run(asyncio.wait_for(collect(), 10))


def bodies_of(events: list[Any]) -> list[dict[str, Any]]:
    return [e["object"] for e in events if isinstance(e, dict)]


def test_without_install_kopf_delivers_managed_fields(monkeypatch) -> None:
    monkeypatch.setattr(watching, "continuous_watch", watching.continuous_watch)  # restored after the test
    if getattr(watching.continuous_watch, "__kvferry_lean__", False):
        monkeypatch.setattr(watching, "continuous_watch", watching.continuous_watch.__wrapped__)
    objs = bodies_of(run_kopf_watch(monkeypatch))
    assert [o["metadata"]["name"] for o in objs] == ["listed", "watched", "listed"]
    assert all(o["metadata"]["managedFields"] == MANAGED for o in objs)


def test_installed_every_listed_and_watched_object_comes_without_managed_fields(monkeypatch) -> None:
    monkeypatch.setattr(watching, "continuous_watch", watching.continuous_watch)  # restored after the test
    assert lean.install()
    assert lean.install()  # a second install does not wrap twice
    assert not getattr(watching.continuous_watch.__wrapped__, "__kvferry_lean__", False)
    events = run_kopf_watch(monkeypatch)
    objs = bodies_of(events)
    assert [e["type"] for e in events if isinstance(e, dict)] == [None, "MODIFIED", "DELETED"]
    assert [o["metadata"]["resourceVersion"] for o in objs] == ["5", "6", "7"]
    assert all("managedFields" not in o["metadata"] for o in objs)
    assert all(o["data"] == {"a": "1"} and o["metadata"]["uid"] for o in objs)  # the rest untouched
    assert watching.Bookmark.LISTED in events


def test_strip_leaves_other_events_alone() -> None:
    assert lean.strip(watching.Bookmark.LISTED) is watching.Bookmark.LISTED
    error = {"type": "ERROR", "object": {"code": 410}}
    assert lean.strip(error) == {"type": "ERROR", "object": {"code": 410}}
