"""Pod step: one thread per pod bound to this node, from volumes and containers to final deletion.

A worker materializes volumes, plans and starts containers (init containers first, one at a time),
then ticks every TICK_S: restarts, probes, and a status write whenever something visible changed
(and every RESYNC_S regardless, so a lost write heals). When the pod is marked for deletion it stops
the containers within the grace period and then deletes the pod object for good, as the kubelet
does; without that last step the pod would stay Terminating forever.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvferry.local.nodeagent import alloc, cgroups, podspec, status, volumes
from kvferry.local.nodeagent.kube import Kube, KubeError
from kvferry.local.nodeagent.runner import ContainerRunner, now_iso

TICK_S = 0.5
RESYNC_S = 10.0
INIT_TIMEOUT_S = 600.0

log = logging.getLogger("kvferry.nodeagent")


class PodWorker:
    """Runs one pod (by uid) until it is deleted or the agent stops."""

    def __init__(
        self,
        kube: Kube,
        pod: dict[str, Any],
        ctx: podspec.PodContext,
        root: Path,
        lookup: podspec.KeyLookup,
        issue_token: volumes.TokenIssuer,
        on_exit: Callable[[PodWorker], None],
        cores: alloc.CorePool | None = None,
        limits: cgroups.CpuLimits | None = None,
    ) -> None:
        self.kube, self.pod, self.ctx, self.root = kube, pod, ctx, root
        self.lookup, self.issue_token, self.on_exit = lookup, issue_token, on_exit
        self.core_pool, self.limits = cores, limits
        self.cores: list[int] = []  # exclusive cores held by this pod's containers
        meta = pod["metadata"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.uid = meta["uid"]
        self.runners: list[ContainerRunner] = []
        self.since: dict[str, str] = {}
        self.start_time = now_iso()
        self.setup_error = ""
        self._delete_grace: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pod-{meta['name']}", daemon=True)

    @property
    def grace_s(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def start(self) -> None:
        self._thread.start()

    def update(self, pod: dict[str, Any]) -> None:
        """A newer version of the pod arrived; a deletion timestamp starts the graceful stop."""
        self.pod = pod
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") and self._delete_grace is None:
            self._delete_grace = float(meta.get("deletionGracePeriodSeconds", self.grace_s))

    def gone(self) -> None:
        """The pod object vanished (force deletion): stop its processes without waiting for more."""
        if self._delete_grace is None:
            self._delete_grace = min(self.grace_s, 5.0)

    def stop(self, wait_s: float) -> None:
        """Agent shutdown: stop the containers (grace capped at `wait_s`), leave the pod object."""
        grace = self.grace_s if self._delete_grace is None else self._delete_grace
        self._delete_grace = min(grace, wait_s)
        self._stop.set()
        self._thread.join(timeout=wait_s + 15)

    # --- thread body -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._setup():
                self._loop()
        except Exception:  # a bug here must not take the agent down; the pod shows it
            log.exception("pod %s: worker failed", self.key)
        finally:
            self._teardown()
            self.on_exit(self)

    def _setup(self) -> bool:
        pod, log_dir = self.pod, self.root
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            dirs = volumes.materialize(pod, self.root, self.lookup, self.issue_token)
            extra = dict(self.ctx.extra_env)
            server = f"https://{self.ctx.apiserver_host}:{self.ctx.apiserver_port}"
            extra.update(volumes.service_account_env(pod, dirs, server))
            self.ctx = podspec.PodContext(**{**self.ctx.__dict__, "volume_dirs": dirs, "extra_env": extra})
            if not self._run_init_containers():
                return False
            self.runners = [
                self._runner(c, pod["spec"].get("restartPolicy", "Always")) for c in self._containers()
            ]
        except KubeError as exc:
            # Transient (API unreachable, token not yet issuable): the worker ends and the next
            # relist of the watch starts a new one, as the kubelet retries a pod sync.
            log.warning("pod %s: setup will be retried: %s", self.key, exc)
            return False
        except (podspec.PodSpecError, OSError) as exc:
            self.setup_error = str(exc)
            log.error("pod %s: %s", self.key, exc)
            self._write_status()
            return False
        return True

    def _containers(self) -> list[dict[str, Any]]:
        return self.pod["spec"].get("containers", [])

    def _runner(self, spec: dict[str, Any], policy: str, pin: bool = True) -> ContainerRunner:
        ctx = self.ctx
        if self.core_pool is not None and pin:
            cores = self.core_pool.take(alloc.whole_cpus(spec))
            self.cores += cores
            extra = {**ctx.extra_env, **alloc.core_env(cores, spec)}
            ctx = podspec.PodContext(**{**ctx.__dict__, "extra_env": extra})
        plan = podspec.plan_container(self.pod, spec, ctx, self.lookup)
        runner = ContainerRunner(spec, plan, self.root, self.ctx.pod_ip, policy, self.grace_s)
        runner.cgroup, runner.limit_note = self._cpu_limit(spec)
        return runner

    def _cpu_limit(self, spec: dict[str, Any]) -> tuple[cgroups.ContainerCgroup | None, str]:
        """The container's cgroup for its limits.cpu, or why it has none (logged and shown)."""
        if self.limits is None:
            return None, ""
        name = spec.get("name", "")
        try:
            millicores = cgroups.cpu_limit(spec)
            if millicores is None:
                return None, ""
            return self.limits.group(self.uid, name, millicores), ""
        except (ValueError, OSError) as exc:
            value = ((spec.get("resources") or {}).get("limits") or {}).get("cpu")
            note = f"container {name}: limits.cpu {value} not enforced: {exc}"
            log.warning("pod %s: %s", self.key, note)
            return None, note

    def _run_init_containers(self) -> bool:
        for spec in self.pod["spec"].get("initContainers") or []:
            runner = self._runner(spec, "OnFailure", pin=False)
            deadline = time.monotonic() + INIT_TIMEOUT_S
            while not runner.finished_ok:
                if self._stop.is_set() or self._delete_grace is not None:
                    runner.stop(0)
                    return False
                if time.monotonic() > deadline:
                    runner.stop(0)
                    raise podspec.PodSpecError(
                        f"init container {spec['name']} ran past {INIT_TIMEOUT_S:.0f} s"
                    )
                runner.tick(time.monotonic())
                time.sleep(TICK_S)
            if runner.cgroup is not None:
                runner.cgroup.remove()
        return True

    def _loop(self) -> None:
        for runner in self.runners:
            runner.start()
        self._write_status()
        last_write = time.monotonic()
        while not self._stop.is_set() and self._delete_grace is None:
            now = time.monotonic()
            changed = [r.tick(now) for r in self.runners]
            if any(changed) or now - last_write > RESYNC_S:
                self._write_status()
                last_write = now
            self._stop.wait(TICK_S)

    def _teardown(self) -> None:
        grace = self._delete_grace if self._delete_grace is not None else self.grace_s
        deleting = bool(self.pod["metadata"].get("deletionTimestamp"))
        if deleting and not self._stop.is_set():
            # As the kubelet: preStop hooks first, all containers at once, within the grace period.
            t0 = time.monotonic()
            hooks = [threading.Thread(target=r.pre_stop, args=(grace,)) for r in self.runners if r.running]
            for t in hooks:
                t.start()
            for t in hooks:
                t.join(timeout=grace)
            grace = max(1.0, grace - (time.monotonic() - t0))
        stoppers = [threading.Thread(target=r.stop, args=(grace,)) for r in self.runners]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        if deleting:
            self._final_delete()
        shutil.rmtree(self.root / "volumes", ignore_errors=True)
        if self.limits is not None:
            self.limits.remove_pod(self.uid)
        if self.core_pool is not None:
            self.core_pool.give_back(self.cores)
            self.cores = []

    def _final_delete(self) -> None:
        meta = self.pod["metadata"]
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        try:
            self.kube.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body)
        except KubeError as exc:
            if exc.status not in (404, 409):
                log.warning("pod %s: final delete failed: %s", self.key, exc)

    def _write_status(self) -> None:
        st = status.pod_status(
            self.pod,
            self.runners,
            self.ctx.pod_ip,
            self.ctx.host_ip,
            self.start_time,
            self.since,
            self.setup_error,
        )
        try:
            status.write_pod_status(self.kube, self.pod, st)
        except KubeError as exc:
            if exc.status != 404:
                log.warning("pod %s: status write failed: %s", self.key, exc)
