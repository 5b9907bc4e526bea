"""A workload check that waits for a reconcile thread no longer holds its object's kopf worker
(operator/fleet/latest.py, issue 19 memory): the handler returns at once, at most `slots` checks run, and a
waiting check is replaced by a newer one of the same object."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
import pytest
from kvferry.operator.fleet.changes import Changes
from kvferry.operator.fleet.latest import Latest
from kvferry.operator.fleet.packed import pack
from kvferry.operator.reconcile import steps
from kvferry.operator.runtime import handlers
from kvferry.operator.runtime.config import OperatorConfig

from tests.unit.operator.cases import make_inference


def test_at_most_slots_run_and_every_key_runs_once() -> None:
    async def scenario() -> tuple[int, list[str]]:
        latest, running, peak, ran = Latest(slots=3), 0, 0, []

        def job(key: str) -> Any:
            async def run() -> None:
                nonlocal running, peak
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.01)
                running -= 1
                ran.append(key)

            return run

        for i in range(10):
            latest.submit(f"k{i}", job(f"k{i}"))
        await latest.drain()
        return peak, ran

    peak, ran = asyncio.run(scenario())
    assert peak == 3
    assert sorted(ran) == sorted(f"k{i}" for i in range(10))


def test_a_waiting_check_is_replaced_by_the_newer_one_and_a_running_one_is_not() -> None:
    async def scenario() -> tuple[list[str], int]:
        latest, ran, gate = Latest(slots=1), [], asyncio.Event()

        def job(name: str, wait: bool = False) -> Any:
            async def run() -> None:
                if wait:
                    await gate.wait()
                ran.append(name)

            return run

        latest.submit("busy", job("busy-1", wait=True))  # takes the only slot
        await asyncio.sleep(0)
        latest.submit("busy", job("busy-2"))  # the running one is not replaced: this one waits
        latest.submit("obj", job("obj-old"))
        latest.submit("obj", job("obj-new"))  # replaces obj-old, which never runs
        latest.submit("busy", job("busy-3"))  # replaces busy-2
        assert len(latest) == 2
        gate.set()
        await latest.drain()
        return ran, latest.replaced

    ran, replaced = asyncio.run(scenario())
    assert ran == ["busy-1", "busy-3", "obj-new"]
    assert replaced == 2


def test_a_failing_check_is_logged_and_the_others_run(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> list[str]:
        latest, ran = Latest(slots=2), []

        async def bad() -> None:
            raise RuntimeError("API server said no")

        async def good() -> None:
            ran.append("good")

        latest.submit("a", bad)
        latest.submit("b", good)
        await latest.drain()
        return ran

    with caplog.at_level(logging.ERROR, logger="kvferry.operator"):
        assert asyncio.run(scenario()) == ["good"]
    assert "workload check of a failed" in caplog.text and "API server said no" in caplog.text


def test_the_owned_handler_returns_while_its_check_waits_and_the_newest_event_is_checked(monkeypatch) -> None:
    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorConfig())
    (owned_changed,) = [h.fn for h in registry._watching.get_all_handlers() if h.id == "owned-statefulsets"]
    cr = make_inference("demo", "ns").obj()
    cr["metadata"]["uid"] = "cr-uid"
    key = ("ns", cr["metadata"]["name"])
    ref = {
        "apiVersion": "kvferry.io/v1alpha1",
        "kind": "DisaggregatedInference",
        "name": key[1],
        "controller": True,
    }
    release, checked = threading.Event(), []

    def on_owned_change(kube: Any, cr: Any, cfg: Any, *, obj: Any, **_: Any) -> steps.Outcome:
        release.wait(10)  # a reconcile thread busy on the API server
        checked.append(obj["spec"]["replicas"])
        return steps.Outcome()

    monkeypatch.setattr(steps, "on_owned_change", on_owned_change)

    def sts(replicas: int) -> dict:
        meta = {"name": "p", "namespace": "ns", "uid": "sts-uid", "ownerReferences": [ref], "labels": {}}
        return {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": meta,
            "spec": {"replicas": replicas},
        }

    async def scenario() -> None:
        memo = kopf.Memo(changes=Changes(), views={}, refreshes=None, kube=None, checks=Latest(slots=1))
        memo.executor = ThreadPoolExecutor(1)
        kw = {"memo": memo, "inferences": {key: [pack(cr)]}, "owned": {}}
        await owned_changed(event={"type": "ADDED"}, body=kopf.Body(sts(1)), **kw)  # first sight: nothing
        for replicas in (2, 3, 4):  # each a shape change: a drift check
            handled = owned_changed(event={"type": "MODIFIED"}, body=kopf.Body(sts(replicas)), **kw)
            await asyncio.wait_for(handled, 2)  # returns although the thread is still busy
            await asyncio.sleep(0.05)
        assert checked == [] and len(memo.checks) == 1  # 2 runs (blocked), 3 was replaced by 4
        release.set()
        await memo.checks.drain()
        memo.executor.shutdown()

    asyncio.run(scenario())
    assert checked == [2, 4]
