"""Watch step: list and watch the pods bound to this node and hand each one to its PodWorker.

Level-based: every round starts with a full list (pods that vanished are stopped, new ones started),
then a bounded watch from the list's resourceVersion feeds changes until the server ends it. A
pod's uid identifies its worker, so a StatefulSet pod recreated under the same name gets a new one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvferry.local.nodeagent.kube import Kube, KubeError

WATCH_TIMEOUT_S = 30
RETRY_S = 1.0

log = logging.getLogger("kvferry.nodeagent")

# Called with a pod dict on add/update, and (uid, None) on removal.
OnPod = Callable[[dict[str, Any]], None]
OnGone = Callable[[str], None]


class PodWatcher:
    """Feeds pod events for `node` to `on_pod` / `on_gone` from a background thread."""

    def __init__(self, kube: Kube, node: str, on_pod: OnPod, on_gone: OnGone) -> None:
        self.kube, self.node = kube, node
        self.on_pod, self.on_gone = on_pod, on_gone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{node}", daemon=True)
        self._known: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        # The watch call returns within WATCH_TIMEOUT_S at most; the thread is a daemon either way.
        self._stop.set()
        self._thread.join(timeout=WATCH_TIMEOUT_S + 20)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self._relist()
                self._watch(version)
            except KubeError as exc:
                if not self._stop.is_set():
                    log.warning("pod watch on %s: %s", self.node, exc)
                self._stop.wait(RETRY_S)

    def _params(self) -> dict[str, str]:
        return {"fieldSelector": f"spec.nodeName={self.node}"}

    def _relist(self) -> str:
        listing = self.kube.get("/api/v1/pods", self._params())
        seen = set()
        for pod in listing.get("items", []):
            seen.add(pod["metadata"]["uid"])
            self.on_pod(pod)
        for uid in self._known - seen:
            self.on_gone(uid)
        self._known = seen
        return listing["metadata"]["resourceVersion"]

    def _watch(self, version: str) -> None:
        params = dict(self._params(), resourceVersion=version)
        for event in self.kube.watch("/api/v1/pods", params, WATCH_TIMEOUT_S):
            if self._stop.is_set():
                return
            kind, obj = event.get("type"), event.get("object", {})
            if kind == "ERROR":
                return  # typically 410 Gone: relist
            if kind in ("ADDED", "MODIFIED"):
                self._known.add(obj["metadata"]["uid"])
                self.on_pod(obj)
            elif kind == "DELETED":
                self._known.discard(obj["metadata"]["uid"])
                self.on_gone(obj["metadata"]["uid"])
