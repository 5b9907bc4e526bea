"""Preset step: hardware presets (presets/*.yaml) merged with a role's spec into what its pods get.

`merge` is the one place where preset data meets user settings; the rule everywhere is "the spec wins":
user env replaces preset env by name, user resources replace preset resources by key, node selectors
merge with user keys on top, tolerations add up.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kvferry.operator.render import groups, images, model
from kvferry.operator.spec import Role, Spec
from kvferry.operator.spec.compile_cache import CompileCache

PRESET_DIR = Path(__file__).parent / "presets"
COMPILE_CACHE_VOLUME = "compile-cache"
LATEST_VLLM = (99, 0)  # presets that name no vllmVersion run kvferry's own vLLM image (current flags)
DEVICE_BUFFER = {"nvidia.com/gpu": "cuda", "aws.amazon.com/neuron": "cuda"}


@functools.cache
def load(accelerator: str) -> dict[str, Any]:
    """Preset data for one accelerator (cached; presets are read-only)."""
    data: dict[str, Any] = yaml.safe_load((PRESET_DIR / f"{accelerator}.yaml").read_text())
    return data


@dataclass(frozen=True)
class PodPlan:
    """Everything a role's engine pods get from preset + spec, before templating."""

    image: str
    env: list[dict[str, Any]]
    resources: dict[str, dict[str, Any]]
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    affinity: dict[str, Any]
    capabilities: list[str]
    run_as_user: int | None  # non-root UID the pods run as; None = the image's user (may be root)
    shm_size: str
    startup_seconds: int
    backends: list[str]
    buffer_device: str
    devices: int
    efa: int
    scheduler_name: str | None  # None: the cluster's default scheduler
    image_pull_secrets: list[str]
    # Neuron presets: (mount path, volume source) of spec.compileCache; None elsewhere.
    compile_cache: tuple[str, dict[str, Any]] | None
    vllm_version: tuple[int, int]  # the image's vLLM (major, minor): flags newer than it are left out


def compile_cache_volume(cache: CompileCache | None) -> dict[str, Any]:
    """The Kubernetes volume source for spec.compileCache (unset: the node-local hostPath default)."""
    cache = cache or CompileCache()
    if cache.volume == "persistentVolumeClaim":
        return {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    if cache.volume == "emptyDir":
        return {"emptyDir": {}}
    return {"hostPath": {"path": cache.path, "type": "DirectoryOrCreate"}}


def block_size(spec: Any) -> int:
    """The KV block size both roles run with: the spec's, else the preset's."""
    return spec.vllm.block_size or int(load(spec.accelerator)["blockSize"])


def scale_quantity(quantity: str, factor: int) -> str:
    """'640Mi' x 2 -> '1280Mi': multiply a Kubernetes quantity, keeping its suffix."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(quantity))
    if not match:
        raise ValueError(f"preset quantity {quantity!r} is not '<number><suffix>'")
    value = float(match.group(1)) * factor
    return f"{int(value) if value.is_integer() else value}{match.group(2)}"


def _vllm_version(preset: dict[str, Any]) -> tuple[int, int]:
    major, minor = preset.get("vllmVersion", LATEST_VLLM)
    return int(major), int(minor)


def _by_name(*env_lists: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for env in env_lists:
        for var in env:
            merged.pop(var["name"], None)  # a later definition moves to the end, after what it may reference
            merged[var["name"]] = var
    return list(merged.values())


def _resources(preset: dict[str, Any], role: Role, devices: int, efa: int) -> dict[str, dict[str, Any]]:
    extended: dict[str, Any] = {}
    if devices:
        extended[preset["accelerator"]["resource"]] = devices
    if efa:
        extended[preset["efa"]["resource"]] = efa
    sized = {k: scale_quantity(v, devices) for k, v in preset.get("perDevice", {}).items()} if devices else {}
    sized |= preset.get("perPod", {})
    # Extended resources and hugepages must have requests == limits; cpu is left unbounded above.
    limits = {k: v for k, v in (extended | sized).items() if k != "cpu"}
    requests = extended | sized
    requests |= role.resources.get("requests", {})
    limits |= role.resources.get("limits", {})
    return {"requests": requests, "limits": limits}


def merge(spec: Spec, role_name: str, registry: str = images.DEFAULT_REGISTRY) -> PodPlan:
    """Combine the spec's preset with one role's settings: the single visible merge.

    registry: where kvferry's own images are pulled from (a preset's `image: {kvferry: vllm}`).
    """
    preset = load(spec.role_accelerator(role_name))  # a role may run on another preset of its family
    role: Role = getattr(spec, role_name)
    accel: dict[str, Any] = preset.get("accelerator") or {}  # cpu and none have no devices
    # Per pod: a role wider than one node has one pod per node (groups.py), each with its share of TP.
    devices = math.ceil(groups.tp_per_pod(spec, role_name) / accel["tpPerDevice"]) if accel else 0
    efa = role.efa
    if efa is None:
        efa = max(1, devices * preset["efa"]["perNode"] // accel["perNode"]) if "efa" in preset else 0
    buffer = spec.kv_transfer.buffer_device
    if buffer == "auto":
        buffer = preset["bufferDevice"]
    elif buffer == "device":
        buffer = DEVICE_BUFFER.get(accel["resource"], "cpu") if accel else "cpu"
    role_env = preset.get("roleEnv", {}).get(role_name, [])
    cache = preset.get("compileCache")
    image = spec.image or images.resolve(preset.get("image"), registry)
    return PodPlan(
        image=image,
        env=_by_name(preset.get("env", []), role_env, role.env),
        # spec.modelStorage: a download into emptyDir requests its size of ephemeral storage (model.py)
        resources=model.with_ephemeral(_resources(preset, role, devices, efa), model.plan(spec).ephemeral),
        node_selector={**preset.get("nodeSelector", {}), **role.node_selector},
        tolerations=[*preset.get("tolerations", []), *role.tolerations],
        affinity=role.affinity,
        capabilities=list(preset.get("capabilities", [])),
        run_as_user=preset.get("runAsUser"),
        shm_size=preset["shmSize"],
        startup_seconds=role.startup_seconds or preset["startupSeconds"],
        backends=spec.kv_transfer.backends or list(preset["backends"]),
        buffer_device=buffer,
        devices=devices,
        efa=efa,
        scheduler_name=role.scheduler_name or preset.get("schedulerName"),
        image_pull_secrets=list(role.image_pull_secrets),
        compile_cache=(cache["mountPath"], compile_cache_volume(spec.compile_cache)) if cache else None,
        # spec.image replaces the preset's image and its vLLM: assume a current one then.
        vllm_version=_vllm_version(preset) if not spec.image else LATEST_VLLM,
    )
