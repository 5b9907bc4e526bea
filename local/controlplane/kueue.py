"""Kueue step: run the Kueue controller (built from sigs.k8s.io/kueue, on demand) against a local plane.

`Kueue(plane).start(workdir)` builds Kueue if it is not cached yet (~15 min cold, build.ON_DEMAND), applies
its CRDs, starts the controller with only the plain-pod integration (what kvferry's gang renders: one pod
group across two StatefulSets), cert rotation, leader election and the visibility API server off, and
registers its webhooks by URL. The pod webhooks skip kube-system, as the release's kustomize patch does.
The CRDs keep Kueue's storage version (v1beta2) and no conversion webhook: everything here speaks v1beta2.

`stop()` leaves the plane as it found it: Kueue's cluster-scoped objects deleted while the controller still
removes its finalizers, webhooks unregistered, the process stopped, then the CRDs deleted, so the API
group is no longer served (the operator's GangAdmitted reads discovery; other tests expect no Kueue).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from kvferry.local.controlplane import build, webhooks
from kvferry.local.controlplane.plane import ControlPlane
from kvferry.local.controlplane.processes import wait_until

GROUP = "kueue.x-k8s.io"
WEBHOOK_PREFIX = "kvferry-local-kueue-"
# The release's pod webhooks skip these namespaces (config/components/webhook/kustomization.yaml); Kueue
# refuses a managed-namespace selector that matches its own namespace.
PODS = {
    "namespaceSelector": {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["kube-system", "kueue-system"],
            }
        ]
    }
}
# Without internal cert management Kueue loads its metrics server's certificate from this fixed path (the
# release mounts a Secret there), even with metrics off: it exits when the files are missing.
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
CLUSTER_SCOPED = (
    "clusterqueues",
    "resourceflavors",
    "cohorts",
    "admissionchecks",
    "topologies",
    "multikueueclusters",
    "multikueueconfigs",
    "provisioningrequestconfigs",
    "workloadpriorityclasses",
)


def config(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """The controller's Configuration file (sigs.k8s.io/kueue apis/config/v1beta2)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},  # the cert comes from the plane's CA
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        # Only plain pods: kvferry's engine pods carry the pod-group labels themselves. With the
        # statefulset integration on, Kueue would claim each StatefulSet as its own group instead.
        "integrations": {"frameworks": ["pod"]},
        "managedJobsNamespaceSelector": PODS["namespaceSelector"],
    }


def in_mount_namespace(argv: list[str], cert_dir: Path) -> list[str]:
    """argv in a private mount namespace where `cert_dir` is bind-mounted at METRICS_CERTS, so nothing
    is written under /etc but the (empty) mount point. Needs root, as the local plane's CI runs."""
    METRICS_CERTS.mkdir(parents=True, exist_ok=True)
    script = f'mount --bind {shlex.quote(str(cert_dir))} {METRICS_CERTS} && exec "$@"'
    # unshare and sh exec in turn: the PID recorded is the controller's own.
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "kueue", *argv]


def crd_files() -> list[Path]:
    src = build.kueue_manifests_dir()
    return [src / name for name in build.KUEUE_MANIFESTS if name.startswith("crd-")]


class Kueue:
    """The Kueue controller and its webhooks on a running ControlPlane."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._ctl = webhooks.ControllerProc(plane, "kueue-controller", build.binary("kueue-controller"))
        self._crds: list[str] = []

    def _established(self) -> bool:
        out = self.plane.kubectl("get", "crd", "-o", "json", *self._crds).stdout
        items = json.loads(out).get("items") or []
        return len(items) == len(self._crds) and all(
            any(c.get("type") == "Established" and c.get("status") == "True" for c in conds)
            for conds in ((i.get("status") or {}).get("conditions") or [] for i in items)
        )

    def start(self, workdir: Path) -> Kueue:
        build.ensure_built(extra=build.ON_DEMAND)
        args: list[str] = []
        for path in crd_files():
            args += ["-f", str(path)]
        out = self.plane.kubectl("apply", "--server-side", "--force-conflicts", "-o", "name", *args).stdout
        self._crds = [line.split("/", 1)[1] for line in out.split()]
        wait_until("Kueue's CRDs established", self._established, 60.0)
        manifests = (build.kueue_manifests_dir() / "webhooks.yaml").read_text()
        self._ctl.start(
            workdir,
            config,
            lambda port, ca: webhooks.by_url(manifests, WEBHOOK_PREFIX, port, ca, PODS),
            # The visibility API server needs an APIService and front-proxy auth this plane lacks.
            extra_args=("--feature-gates=VisibilityOnDemand=false",),
            wrap=in_mount_namespace,
        )
        return self

    def stop(self) -> None:
        """Undo start (see the module docstring). Safe to call twice."""
        if self._ctl.proc is not None:
            kinds = ",".join(CLUSTER_SCOPED)
            self.plane.kubectl("delete", kinds, "--all", "--wait=false", check=False)
        self._ctl.stop()
        if self._crds:
            # Finalizers the stopped controller can no longer remove would hold pods, namespaces and
            # the CRDs' deletion: drop Kueue's (only Kueue's) from whatever still carries them.
            self.drop_finalizers(",".join(("pods", *CLUSTER_SCOPED, "workloads", "localqueues")))
            self.plane.kubectl(
                "delete", "crd", "--wait=false", "--ignore-not-found", *self._crds, check=False
            )
            wait_until(f"the {GROUP} API group gone", self._group_gone, 60.0)
            self._crds = []

    def drop_finalizers(self, kinds: str, namespace: str | None = None) -> None:
        """Remove Kueue's finalizers from objects of `kinds` (comma-separated) in `namespace` or all.
        Kueue keeps a deleted pod's finalizer until the kubelet reports it terminal, which kwok never
        does: tests release their pods with this."""
        where = ["-n", namespace] if namespace else ["-A"]
        out = self.plane.kubectl("get", kinds, *where, "-o", "json", check=False).stdout or "{}"
        for obj in json.loads(out).get("items") or []:
            meta = obj["metadata"]
            have = meta.get("finalizers") or []
            keep = [f for f in have if not f.startswith(GROUP + "/")]
            if keep == have:
                continue
            ref = [f"{obj['kind'].lower()}.{obj['apiVersion'].split('/')[0]}/{meta['name']}"]
            if "/" not in obj["apiVersion"]:  # core group (pods)
                ref = [f"{obj['kind'].lower()}/{meta['name']}"]
            ns = ["-n", meta["namespace"]] if meta.get("namespace") else []
            patch = json.dumps({"metadata": {"finalizers": keep or None}})
            self.plane.kubectl(*ns, "patch", *ref, "--type=merge", "-p", patch, check=False)

    def _group_gone(self) -> bool:
        res = self.plane.kubectl("get", "--raw", f"/apis/{GROUP}", check=False)
        return bool(res.returncode != 0)

    def __enter__(self) -> Kueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
