"""A watch that records every stored version of a namespace's CRs, in order (a status that holds for one
write and is replaced at the next is still seen). Registered as a plugin in tests/conftest.py: a test
requests `status_log` before it changes anything it wants recorded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import watch
from kvferry.operator.spec import GROUP, PLURAL, VERSION


class StatusLog:
    """Every stored version of the namespace's CRs, in order, as a watch delivers them."""

    def __init__(self, cluster) -> None:
        self.versions: list[tuple[str, dict[str, Any]]] = []  # (CR name, status)
        self.closed, self.error = False, ""
        listed = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL)
        self._watch = watch.Watch()
        stream = self._watch.stream(
            cluster.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            cluster.ns,
            PLURAL,
            resource_version=listed["metadata"]["resourceVersion"],
            timeout_seconds=300,
        )
        self._thread = threading.Thread(target=self._record, args=(stream,), daemon=True)
        self._thread.start()

    def _record(self, stream) -> None:
        try:
            for event in stream:
                obj = event["object"]
                self.versions.append((obj["metadata"]["name"], obj.get("status") or {}))
        except Exception as exc:  # the connection ends when the control plane stops after the test
            if not self.closed:
                self.error = repr(exc)

    def close(self) -> None:
        self.closed = True
        self._watch.stop()

    def runs(self, name: str, ctype: str) -> list[tuple[str, str]]:
        """(status, reason) of condition `ctype` across every version of `name`, repeats folded."""
        assert not self.error, f"the watch broke, versions may be missing: {self.error}"
        out: list[tuple[str, str]] = []
        for cr, status in list(self.versions):
            cond = next((c for c in status.get("conditions", []) if c["type"] == ctype), None)
            value = (cond["status"], cond["reason"]) if cond else None
            if cr == name and value and (not out or out[-1] != value):
                out.append(value)
        return out

    def seen(self, name: str, ctype: str, status: str, generation: int) -> bool:
        """Whether any stored version of `name` had `ctype` at `status` for `generation`."""
        return any(
            c.get("type") == ctype and c.get("status") == status and c.get("observedGeneration") == generation
            for cr, st in list(self.versions)
            if cr == name
            for c in st.get("conditions", [])
        )

    def flaps(self, name: str) -> dict[str, list[tuple[str, str]]]:
        """Conditions of `name` that came back to a value they had left."""
        types = {c["type"] for cr, st in self.versions if cr == name for c in st.get("conditions", [])}
        return {t: r for t in types if len(set(r := self.runs(name, t))) != len(r)}

    def transfers(self, name: str) -> set[int]:
        return {st.get("transfer", {}).get("transfers", -1) for cr, st in list(self.versions) if cr == name}


@pytest.fixture
def status_log(cluster) -> Iterator[StatusLog]:
    log = StatusLog(cluster)
    yield log
    log.close()
