"""Volume step: materialize a pod's volumes as local directories before its containers start.

- configMap / secret: the keys (or the listed `items`) written as files, as the kubelet mounts them.
- emptyDir: a fresh directory; an emptyDir mounted at /dev/shm is left out, because every local
  process already shares the machine's /dev/shm.
- hostPath: the host path itself.
- persistentVolumeClaim: the directory of the PersistentVolume bound to the claim, when that volume is
  a hostPath or local one (a path on this machine); any other kind cannot be mounted by a process.
- projected: service-account token (TokenRequest bound to the pod), configMap keys and downward-API
  fields. Python's in-cluster loader reads a fixed path under /var/run/secrets, which a local process
  cannot have per pod, so the agent also writes a `kubeconfig` with the same token and CA next to the
  token and points KUBECONFIG at it (see `service_account_env`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kvferry.local.nodeagent.podspec import KeyLookup, PodSpecError

# (namespace, service account, pod name, pod uid, audience or None, seconds) -> token
TokenIssuer = Callable[[str, str, str, str, str | None, int], str]

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _write(directory: Path, rel: str, content: str, mode: int | None) -> None:
    target = directory / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    if mode is not None:
        target.chmod(mode)


def _write_keys(
    directory: Path, values: dict[str, str], items: list[dict[str, Any]] | None, mode: int | None
):
    if items:
        for item in items:
            if item["key"] in values:
                _write(directory, item["path"], values[item["key"]], item.get("mode", mode))
    else:
        for key, value in values.items():
            _write(directory, key, value, mode)


def _key_source(lookup: KeyLookup, kind: str, ns: str, ref: dict[str, Any], pod: str) -> dict[str, str]:
    name = ref.get("name") or ref.get("secretName", "")
    values = lookup(kind, ns, name)
    if values is None:
        if ref.get("optional"):
            return {}
        raise PodSpecError(f"pod {pod}: {kind} {ns}/{name} for a volume does not exist")
    return values


def _downward(pod: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, str]:
    out = {}
    for item in items:
        path = (item.get("fieldRef") or {}).get("fieldPath", "")
        if path == "metadata.namespace":
            out[item["path"]] = pod["metadata"].get("namespace", "")
        elif path == "metadata.name":
            out[item["path"]] = pod["metadata"].get("name", "")
        elif path in ("metadata.labels", "metadata.annotations"):
            kv = pod["metadata"].get(path.split(".")[1]) or {}
            out[item["path"]] = "\n".join(f'{k}="{v}"' for k, v in sorted(kv.items()))
    return out


def _projected(pod, volume, directory: Path, lookup: KeyLookup, issue_token: TokenIssuer) -> None:
    meta = pod["metadata"]
    ns, sa = meta.get("namespace", "default"), pod["spec"].get("serviceAccountName", "default")
    mode = volume["projected"].get("defaultMode")
    for source in volume["projected"].get("sources") or []:
        if "serviceAccountToken" in source:
            spec = source["serviceAccountToken"]
            token = issue_token(
                ns,
                sa,
                meta["name"],
                meta.get("uid", ""),
                spec.get("audience"),
                spec.get("expirationSeconds", 3607),
            )
            _write(directory, spec.get("path", "token"), token, mode)
        elif "configMap" in source:
            values = _key_source(lookup, "configMap", ns, source["configMap"], meta["name"])
            _write_keys(directory, values, source["configMap"].get("items"), mode)
        elif "secret" in source:
            values = _key_source(lookup, "secret", ns, source["secret"], meta["name"])
            _write_keys(directory, values, source["secret"].get("items"), mode)
        elif "downwardAPI" in source:
            _write_keys(directory, _downward(pod, source["downwardAPI"].get("items") or []), None, mode)


def materialize(
    pod: dict[str, Any], root: Path, lookup: KeyLookup, issue_token: TokenIssuer
) -> dict[str, str | None]:
    """Create every volume of `pod` under `root`; return volume name -> local dir (None = ignored)."""
    meta, spec = pod["metadata"], pod.get("spec", {})
    ns, name = meta.get("namespace", "default"), meta["name"]
    mounts = {
        m["name"]: m["mountPath"] for c in spec.get("containers", []) for m in c.get("volumeMounts") or []
    }
    dirs: dict[str, str | None] = {}
    for volume in spec.get("volumes") or []:
        vname = volume["name"]
        directory = root / "volumes" / vname
        if "hostPath" in volume:
            dirs[vname] = volume["hostPath"]["path"]
            continue
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            dirs[vname] = _key_source(lookup, "persistentVolumeClaim", ns, {"name": claim}, name)["path"]
            continue
        if "emptyDir" in volume and mounts.get(vname, "").rstrip("/") == "/dev/shm":
            dirs[vname] = None
            continue
        directory.mkdir(parents=True, exist_ok=True)
        dirs[vname] = str(directory)
        if "configMap" in volume:
            values = _key_source(lookup, "configMap", ns, volume["configMap"], name)
            _write_keys(
                directory, values, volume["configMap"].get("items"), volume["configMap"].get("defaultMode")
            )
        elif "secret" in volume:
            values = _key_source(lookup, "secret", ns, volume["secret"], name)
            _write_keys(directory, values, volume["secret"].get("items"), volume["secret"].get("defaultMode"))
        elif "projected" in volume:
            _projected(pod, volume, directory, lookup, issue_token)
        elif "emptyDir" not in volume:
            kinds = sorted(k for k in volume if k != "name")
            raise PodSpecError(f"pod {name}: volume {vname!r} of kind {kinds} is not supported locally")
    return dirs


def service_account_env(pod: dict[str, Any], dirs: dict[str, str | None], server: str) -> dict[str, str]:
    """KUBECONFIG for a pod that mounts a service-account token, written beside the token."""
    for container in pod["spec"].get("containers", []):
        for mount in container.get("volumeMounts") or []:
            local = dirs.get(mount["name"])
            if mount["mountPath"].rstrip("/") == SA_MOUNT and local and os.path.exists(f"{local}/token"):
                return {"KUBECONFIG": _write_kubeconfig(Path(local), server, pod["metadata"]["namespace"])}
    return {}


def _write_kubeconfig(directory: Path, server: str, namespace: str) -> str:
    cluster = {"server": server}
    if (directory / "ca.crt").exists():
        cluster["certificate-authority"] = str(directory / "ca.crt")
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": "sa", "user": {"tokenFile": str(directory / "token")}}],
        "contexts": [{"name": "pod", "context": {"cluster": "local", "user": "sa", "namespace": namespace}}],
        "current-context": "pod",
    }
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return str(path)
