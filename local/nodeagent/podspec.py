"""Launch step: turn one pod's container spec into a local command line, environment and working dir.

Pure: the caller passes the pod, the addresses it was given, where each volume lives on this machine
and a lookup for ConfigMap/Secret keys. Kubernetes semantics kept: env in order with `$(VAR)`
expansion (and `$$` escapes), field/resource refs, envFrom with prefixes, `$(VAR)` in command and
args. Images are ignored (the local virtualenv is "the image"), so a container must give `command`.
Paths under a volume's mountPath are rewritten to the volume's local directory.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# (kind "configMap"|"secret", namespace, name, key or None for all keys) -> value(s); None if missing.
KeyLookup = Callable[[str, str, str], dict[str, str] | None]

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodSpecError(ValueError):
    """The pod cannot run on the local node; the message names the pod, container and field."""


@dataclass(frozen=True)
class PodContext:
    """What the node decided for a pod before its containers start."""

    pod_ip: str
    host_ip: str
    apiserver_host: str
    apiserver_port: int
    # volume name -> local directory (None: ignored, e.g. an emptyDir at /dev/shm)
    volume_dirs: dict[str, str | None] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    exec_prefix: tuple[str, ...] = ()  # runs a command inside the node's network namespace


@dataclass(frozen=True)
class LaunchPlan:
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    exec_prefix: tuple[str, ...] = ()


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: unknown references stay as written, `$$` becomes `$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, text)


def _field_ref(pod: dict[str, Any], ctx: PodContext, path: str, where: str) -> str:
    meta, spec = pod["metadata"], pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": ctx.pod_ip,
        "status.podIPs": ctx.pod_ip,
        "status.hostIP": ctx.host_ip,
        "status.hostIPs": ctx.host_ip,
    }
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise PodSpecError(f"{where}: fieldRef.fieldPath {path!r} is not supported by the local node agent")


def _resource_ref(container: dict[str, Any], ref: dict[str, Any]) -> str:
    # Enough for the usual `limits.cpu`/`requests.memory` refs; divisor is ignored (values as written).
    kind, _, name = ref.get("resource", "").partition(".")
    value = (container.get("resources", {}).get(kind) or {}).get(name)
    return str(value) if value is not None else "0"


def _lookup_key(lookup: KeyLookup, kind: str, ns: str, ref: dict[str, Any], where: str) -> str | None:
    values = lookup(kind, ns, ref.get("name", ""))
    if values is None or ref.get("key") not in values:
        if ref.get("optional"):
            return None
        raise PodSpecError(f"{where}: {kind} {ns}/{ref.get('name')} has no key {ref.get('key')!r}")
    return values[ref["key"]]


def _env_from(
    pod: dict[str, Any], container: dict[str, Any], lookup: KeyLookup, where: str
) -> dict[str, str]:
    ns, env = pod["metadata"].get("namespace", "default"), {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("configMap", "configMapRef"), ("secret", "secretRef")):
            if key not in source:
                continue
            values = lookup(kind, ns, source[key].get("name", ""))
            if values is None and not source[key].get("optional"):
                raise PodSpecError(f"{where}: envFrom {kind} {ns}/{source[key].get('name')} not found")
            env.update({prefix + k: v for k, v in (values or {}).items()})
    return env


def build_env(
    pod: dict[str, Any], container: dict[str, Any], ctx: PodContext, lookup: KeyLookup
) -> dict[str, str]:
    """The container's environment as a kubelet would build it (service links aside)."""
    where = f"pod {pod['metadata'].get('name')} container {container.get('name')}"
    ns = pod["metadata"].get("namespace", "default")
    env: dict[str, str] = {
        "HOSTNAME": pod["metadata"].get("name", ""),
        "KUBERNETES_SERVICE_HOST": ctx.apiserver_host,
        "KUBERNETES_SERVICE_PORT": str(ctx.apiserver_port),
    }
    env.update(ctx.extra_env)
    env.update(_env_from(pod, container, lookup, where))
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        value: str | None
        if source is None:
            value = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            value = _field_ref(pod, ctx, source["fieldRef"].get("fieldPath", ""), f"{where} env {name}")
        elif "resourceFieldRef" in source:
            value = _resource_ref(container, source["resourceFieldRef"])
        elif "configMapKeyRef" in source:
            value = _lookup_key(lookup, "configMap", ns, source["configMapKeyRef"], f"{where} env {name}")
        elif "secretKeyRef" in source:
            value = _lookup_key(lookup, "secret", ns, source["secretKeyRef"], f"{where} env {name}")
        else:
            raise PodSpecError(f"{where} env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def path_map(pod: dict[str, Any], container: dict[str, Any], ctx: PodContext) -> list[tuple[str, str]]:
    """(mountPath, local dir) pairs, longest mountPath first so nested mounts win."""
    pairs = []
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in ctx.volume_dirs:
            raise PodSpecError(
                f"pod {pod['metadata'].get('name')} container {container.get('name')}: "
                f"volumeMount {mount['name']!r} names no volume of the pod"
            )
        local = ctx.volume_dirs[mount["name"]]
        if local is None:
            continue
        if mount.get("subPath"):
            local = f"{local}/{mount['subPath']}"
        pairs.append((mount["mountPath"].rstrip("/") or "/", local))
    return sorted(pairs, key=lambda p: len(p[0]), reverse=True)


def map_paths(text: str, pairs: list[tuple[str, str]]) -> str:
    """Rewrite each mountPath that starts a path (after start, '=', ':' or ',') to its local dir.

    One pass over the text: a rewritten path (e.g. under /tmp) must not be rewritten again by a
    mount at /tmp.
    """
    if not pairs:
        return text
    local = dict(pairs)
    alternatives = "|".join(re.escape(mount) for mount, _ in pairs)  # longest first: nested mounts win
    pattern = re.compile(r"(^|[=:,])(" + alternatives + r")(?=/|$|[,:])")
    return pattern.sub(lambda m: m.group(1) + local[m.group(2)], text)


def plan_container(
    pod: dict[str, Any], container: dict[str, Any], ctx: PodContext, lookup: KeyLookup
) -> LaunchPlan:
    """Command line, environment and working directory for one container."""
    name = container.get("name", "")
    if not container.get("command"):
        raise PodSpecError(
            f"pod {pod['metadata'].get('name')} container {name}: no `command`; the local node agent "
            f"ignores images (image {container.get('image')!r}), so the command must be given in the spec"
        )
    env = build_env(pod, container, ctx, lookup)
    pairs = path_map(pod, container, ctx)
    # Only the spec's values are container paths; the agent's own (KUBECONFIG, PATH) are host paths.
    env = {k: v if ctx.extra_env.get(k) == v else map_paths(v, pairs) for k, v in env.items()}
    argv = [map_paths(expand(a, env), pairs) for a in container["command"] + (container.get("args") or [])]
    cwd = map_paths(container["workingDir"], pairs) if container.get("workingDir") else None
    prefix = ctx.exec_prefix
    return LaunchPlan(name=name, argv=[*prefix, *argv], env=env, cwd=cwd, exec_prefix=prefix)
