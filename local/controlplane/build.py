"""Build step: compile the pinned control-plane binaries from their Go modules into $KVFERRY_BIN, once.

Each component is built in its own throwaway Go module under $KVFERRY_CACHE/gobuild/ (so MVS never mixes
etcd's and Kubernetes' grpc/otel versions) and leaves a stamp naming its version; a second run sees the
stamp and the binaries and returns at once. GOMODCACHE and GOCACHE stay at Go's defaults so they survive
across checkouts. A file lock keeps two test sessions from building at the same time.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kvferry.local.controlplane import versions

BUILD_STEP_TIMEOUT_S = 3 * 3600  # a cold kube build on 2 busy cores takes tens of minutes
LOCK_TIMEOUT_S = 3 * 3600
KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
KWOK_STAGE_FILES = (  # v0.8.0 has no built-in stages: pass these as --config
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
)


_progress: TextIO = sys.stdout  # where progress lines go; ensure_built(out=...) sets it


class BuildError(RuntimeError):
    """A build step failed; the message names the step and its log file."""


@dataclass(frozen=True)
class Component:
    name: str
    version: str
    binaries: tuple[str, ...]


COMPONENTS = (
    Component("kubernetes", versions.KUBERNETES, KUBE_COMMANDS),
    Component("etcd", versions.ETCD, ("etcd",)),
    Component("kwok", versions.KWOK, ("kwok",)),
    Component("helm", versions.HELM, ("helm",)),
    Component("lws", versions.LWS, ("lws-controller",)),
)
# Built only when asked for (`ensure_built(ON_DEMAND)`, `kvferry cluster build --with kueue`): Kueue's
# cold build alone is ~15 min on 2 cores; a test run builds it in the background (tests/cluster/on_demand.py).
ON_DEMAND = (Component("kueue", versions.KUEUE, ("kueue-controller",)),)


def cache_dir() -> Path:
    return Path(os.environ.get("KVFERRY_CACHE", Path.home() / ".cache" / "kvferry"))


def bin_dir() -> Path:
    return Path(os.environ.get("KVFERRY_BIN", cache_dir() / "bin"))


def share_dir() -> Path:
    """Non-binary build outputs (kwok stage config)."""
    return cache_dir() / "controlplane"


def kwok_stages_path() -> Path:
    return share_dir() / f"kwok-stages-v{versions.KWOK}.yaml"


def lws_manifests_dir() -> Path:
    """LWS's CRD and webhook configurations, copied from its module (applied by lws.py)."""
    return share_dir() / f"lws-v{versions.LWS}"


def kueue_manifests_dir() -> Path:
    """Kueue's CRDs and webhook configurations, copied from its module (applied by kueue.py)."""
    return share_dir() / f"kueue-v{versions.KUEUE}"


KUEUE_CRDS = (  # every CRD of the release: the controller sets up indexes on all of them at start-up
    "admissionchecks",
    "clusterqueues",
    "cohorts",
    "localqueues",
    "multikueueclusters",
    "multikueueconfigs",
    "provisioningrequestconfigs",
    "resourceflavors",
    "topologies",
    "workloadpriorityclasses",
    "workloads",
)
KUEUE_MANIFESTS = {  # file written -> its path in the sigs.k8s.io/kueue module
    "webhooks.yaml": "config/components/webhook/manifests.yaml",
    **{f"crd-{kind}.yaml": f"config/components/crd/bases/kueue.x-k8s.io_{kind}.yaml" for kind in KUEUE_CRDS},
}


LWS_MANIFESTS = {  # file written -> its path in the sigs.k8s.io/lws module
    "crd.yaml": "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    "webhooks.yaml": "config/webhook/manifests.yaml",
}


def binary(name: str) -> Path:
    return bin_dir() / name


def _stamp(comp: Component) -> Path:
    return bin_dir() / ".stamps" / f"{comp.name}-v{comp.version}.json"


def is_built(comp: Component) -> bool:
    if not _stamp(comp).is_file():
        return False
    if comp.name == "kwok" and not kwok_stages_path().is_file():
        return False
    if comp.name == "lws" and not all((lws_manifests_dir() / f).is_file() for f in LWS_MANIFESTS):
        return False
    if comp.name == "kueue" and not all((kueue_manifests_dir() / f).is_file() for f in KUEUE_MANIFESTS):
        return False
    return all(os.access(binary(b), os.X_OK) for b in comp.binaries)


def missing(extra: tuple[Component, ...] = ()) -> list[Component]:
    return [c for c in (*COMPONENTS, *extra) if not is_built(c)]


def go_binary() -> str:
    """The `go` command, checked against versions.GO_MIN; the error says what to install."""
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        raise BuildError(f"no `go` on PATH or at /usr/local/go/bin/go; need Go >= {versions.GO_MIN}")
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60).stdout
    m = re.match(r"go(\d+)\.(\d+)", out.strip())
    if not m or (int(m[1]), int(m[2])) < versions.GO_MIN:
        raise BuildError(f"{go} reports {out.strip()!r}; need Go >= {'.'.join(map(str, versions.GO_MIN))}")
    return go


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # -mod=mod: the throwaway modules have no go.sum until go fills it; GOTOOLCHAIN=local: never download
    # a toolchain; CGO off: static binaries, no C toolchain needed, as Kubernetes releases are built.
    env.update(GOFLAGS="-mod=mod -buildvcs=false", GOTOOLCHAIN="local", CGO_ENABLED="0")
    return env


def _run(cmd: list[str], cwd: Path, log: Path, what: str) -> str:
    """Run one go command with output appended to `log`; print a line every 250 packages compiled."""
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=_go_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        watchdog = threading.Timer(BUILD_STEP_TIMEOUT_S, proc.kill)  # go may hang silently (network)
        watchdog.start()
        out: list[str] = []
        try:
            assert proc.stdout is not None
            for n, line in enumerate(proc.stdout, 1):
                fh.write(line)
                out.append(line)
                if n % 250 == 0:
                    print(f"  [{what}] {n} lines of go output (log: {log})", file=_progress, flush=True)
            rc = proc.wait(timeout=60)  # stdout closed: the process is exiting
        finally:
            watchdog.cancel()
    if rc != 0:
        tail = "".join(out[-15:])
        timed_out = f" after the {BUILD_STEP_TIMEOUT_S} s limit" if rc == -9 else ""
        raise BuildError(f"{what}: `{' '.join(cmd[:3])} ...` failed (rc={rc}){timed_out}; log: {log}\n{tail}")
    return "".join(out)


def _init_module(name: str) -> Path:
    work = cache_dir() / "gobuild" / name
    work.mkdir(parents=True, exist_ok=True)
    for f in ("go.mod", "go.sum"):
        (work / f).unlink(missing_ok=True)
    (work / "go.mod").write_text(f"module kvferry.local/build/{name}\n\ngo 1.26\n")
    return work


def _module_info(go: str, work: Path, log: Path, mod: str) -> dict[str, str]:
    out = _run([go, "mod", "download", "-json", mod], work, log, f"download {mod}")
    return json.loads(out[out.index("{") :])


def _kube_ldflags() -> str:
    # Without these the servers report v0.0.0-master+$Format:%H$, which helm and kubectl reject.
    flags = ["-s", "-w"]
    v, minor = versions.KUBERNETES, versions.kube_minor()
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.{k}={val}" for k, val in (("gitVersion", f"v{v}"), ("gitMajor", "1"))]
        flags += [f"-X {pkg}.gitMinor={minor}", f"-X {pkg}.gitTreeState=clean"]
        flags += [f"-X {pkg}.buildDate=1970-01-01T00:00:00Z"]
    return " ".join(flags)


def _build_kubernetes(go: str, log: Path) -> None:
    work = _init_module("kubernetes")
    mod = f"k8s.io/kubernetes@v{versions.KUBERNETES}"
    gomod = Path(_module_info(go, work, log, mod)["GoMod"]).read_text()
    # k/k requires its staging modules at v0.0.0 and replaces them with ./staging paths; a consumer must
    # replace each with its released v0.<minor>.<patch> tag. The main module's godebug line is the one used.
    staging = re.findall(r"^\s*(k8s\.io/\S+) => \./staging/", gomod, re.M)
    if not staging:
        raise BuildError(f"no staging replaces found in the go.mod of {mod}")
    edits = [f"-replace={m}={m}@{versions.staging_version()}" for m in staging]
    godebug = re.search(r"^godebug (\S+)", gomod, re.M)
    if godebug:
        edits.append(f"-godebug={godebug[1]}")
    _run([go, "mod", "edit", *edits], work, log, "kubernetes go.mod")
    pkgs = [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS]
    _run([go, "get", *(f"{p}@v{versions.KUBERNETES}" for p in pkgs)], work, log, "kubernetes go get")
    # One `go build` for all four commands: they share most packages, so this compiles them once.
    cmd = [go, "build", "-v", "-trimpath", "-ldflags", _kube_ldflags(), "-o", str(bin_dir()) + "/", *pkgs]
    _run(cmd, work, log, "kubernetes go build")


def _build_single(go: str, log: Path, name: str, pkg: str, version: str, out: str, ldflags: str) -> None:
    work = _init_module(name)
    _run([go, "get", f"{pkg}@v{version}"], work, log, f"{name} go get")
    cmd = [
        go,
        "build",
        "-v",
        "-trimpath",
        "-ldflags",
        f"-s -w {ldflags}".strip(),
        "-o",
        str(binary(out)),
        pkg,
    ]
    _run(cmd, work, log, f"{name} go build")


def _build_etcd(go: str, log: Path) -> None:
    # The server module's root is `package main`; building it as a dependency avoids its ../api replaces.
    _build_single(go, log, "etcd", "go.etcd.io/etcd/server/v3", versions.ETCD, "etcd", "")


def _build_kwok(go: str, log: Path) -> None:
    _build_single(go, log, "kwok", "sigs.k8s.io/kwok/cmd/kwok", versions.KWOK, "kwok", "")
    src = Path(
        _module_info(go, cache_dir() / "gobuild" / "kwok", log, f"sigs.k8s.io/kwok@v{versions.KWOK}")["Dir"]
    )
    docs = [(src / "kustomize" / "stage" / f).read_text().strip() for f in KWOK_STAGE_FILES]
    share_dir().mkdir(parents=True, exist_ok=True)
    kwok_stages_path().write_text("\n---\n".join(docs) + "\n")


def _build_lws(go: str, log: Path) -> None:
    # Its own module: LWS pins an older client-go and controller-runtime than the Kubernetes build.
    _build_single(go, log, "lws", "sigs.k8s.io/lws/cmd", versions.LWS, "lws-controller", "")
    src = Path(
        _module_info(go, cache_dir() / "gobuild" / "lws", log, f"sigs.k8s.io/lws@v{versions.LWS}")["Dir"]
    )
    out = lws_manifests_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name, path in LWS_MANIFESTS.items():
        (out / name).write_text((src / path).read_text())


def _build_kueue(go: str, log: Path) -> None:
    # Its own module too: Kueue requires every job framework it integrates (Kubeflow, Ray, JobSet, ...).
    _build_single(go, log, "kueue", "sigs.k8s.io/kueue/cmd/kueue", versions.KUEUE, "kueue-controller", "")
    work = cache_dir() / "gobuild" / "kueue"
    src = Path(_module_info(go, work, log, f"sigs.k8s.io/kueue@v{versions.KUEUE}")["Dir"])
    out = kueue_manifests_dir()
    out.mkdir(parents=True, exist_ok=True)
    for name, path in KUEUE_MANIFESTS.items():
        (out / name).write_text((src / path).read_text())


def _build_helm(go: str, log: Path) -> None:
    # Version ldflags as helm's Makefile sets them, so `helm version` and .Capabilities are right.
    minor = versions.kube_minor()
    ldflags = " ".join(
        [
            f"-X helm.sh/helm/v3/internal/version.version=v{versions.HELM}",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
            "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1",
            f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={minor}",
            "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1",
            f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor={minor}",
        ]
    )
    _build_single(go, log, "helm", "helm.sh/helm/v3/cmd/helm", versions.HELM, "helm", ldflags)


BUILDERS = {
    "kubernetes": _build_kubernetes,
    "etcd": _build_etcd,
    "kwok": _build_kwok,
    "helm": _build_helm,
    "lws": _build_lws,
    "kueue": _build_kueue,
}


@contextmanager
def _build_lock() -> Iterator[None]:
    share_dir().mkdir(parents=True, exist_ok=True)
    with (share_dir() / "build.lock").open("w") as fh:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"another build held {fh.name} for {LOCK_TIMEOUT_S} s") from None
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_built(out: TextIO | None = None, extra: tuple[Component, ...] = ()) -> dict[str, float]:
    """Build whatever is missing of COMPONENTS and `extra` (e.g. ON_DEMAND); return seconds spent per
    component (empty when all was cached)."""
    global _progress
    out = out or sys.stdout
    _progress = out
    if not missing(extra):
        return {}
    with _build_lock():
        todo = missing(extra)  # another session may have built them while we waited
        if not todo:
            return {}
        go = go_binary()
        bin_dir().mkdir(parents=True, exist_ok=True)
        (bin_dir() / ".stamps").mkdir(exist_ok=True)
        times: dict[str, float] = {}
        for comp in todo:
            log = share_dir() / f"build-{comp.name}.log"
            print(f"[kvferry cluster build] {comp.name} v{comp.version} (log: {log})", file=out, flush=True)
            t0 = time.monotonic()
            BUILDERS[comp.name](go, log)
            times[comp.name] = time.monotonic() - t0
            stamp = {"version": comp.version, "binaries": comp.binaries, "seconds": round(times[comp.name])}
            _stamp(comp).write_text(json.dumps(stamp) + "\n")
            print(
                f"[kvferry cluster build] {comp.name} done in {times[comp.name]:.0f} s", file=out, flush=True
            )
        return times
