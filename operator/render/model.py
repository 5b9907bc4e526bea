"""Model step: what `spec.model`'s source and `spec.modelStorage` add to each engine pod (pure).

One role's volumes, mounts, env, vLLM model argument and ephemeral-storage, by source (docs/models.md):

- hub (hf:// or a bare id): HF_HOME on the cache volume. emptyDir is per pod, sized by
  modelStorage.size (its sizeLimit and the container's ephemeral-storage request and limit, since the
  kubelet evicts a pod past its limit and schedules by the request); hostPath is shared by the prefill
  and decode pods on a node and survives restarts; a ReadWriteMany claim is shared by all pods.
- pvc://CLAIM/PATH: the claim mounted read-only at /mnt/models (KServe's mount point), vLLM given the
  folder, HF_HUB_OFFLINE=1 so nothing is ever downloaded. Both roles mount the same claim.
- s3://: `--load-format runai_streamer` (vLLM's Run:ai model streamer reads the weights from S3 into
  memory, no local copy); credentials come from the pods' service account (IRSA / EKS Pod Identity).
- /PATH: inside the image, nothing added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from kvferry.operator.spec import Spec
from kvferry.operator.spec.model_storage import ModelStorage, parse_source
from kvferry.operator.spec.quantity import quantity

SOURCE_VOLUME = "model"
SOURCE_MOUNT = "/mnt/models"
CACHE_VOLUME = "model-cache"
CACHE_MOUNT = "/var/cache/kvferry-models"
# Beyond the model: the scratch emptyDir (vLLM, torch and Triton caches under /tmp and HOME) and the
# container's logs count against the same ephemeral-storage limit. A kvferry choice, not a vendor figure.
SCRATCH_HEADROOM = "10Gi"
RUNAI_STREAMER = ["--load-format", "runai_streamer"]  # vLLM docs, "Loading models with Run:ai Model Streamer"


@dataclass
class ModelPlan:
    model_arg: str  # vLLM's positional model argument
    served_name: str  # --served-model-name default and the router's model
    args: list[str] = field(default_factory=list)  # added after the rendered args, before extraArgs
    env: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    ephemeral: str | None = None  # ephemeral-storage request and limit
    service_account: str | None = None


def served_name(spec: Spec) -> str:
    """What clients call the model: spec.servedModelName, else the hub id or image path as before model
    URIs, else (pvc://, s3://) the URI's last folder."""
    if spec.served_model_name:
        return spec.served_model_name
    source = parse_source(spec.model)
    if source.kind in ("hub", "path"):
        return source.model
    return spec.model.rstrip("/").rsplit("/", 1)[-1] or spec.model


def plan(spec: Spec) -> ModelPlan:
    """The same for both roles: P and D of one CR read one model from one place."""
    storage = spec.model_storage or ModelStorage()
    source = parse_source(spec.model)
    out = ModelPlan(source.model, served_name(spec), service_account=storage.service_account_name)
    if source.kind == "hub":
        out.env.append({"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"})
        out.volumes.append({"name": CACHE_VOLUME, **_cache_volume(storage)})
        out.mounts.append({"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT})
        if storage.cache == "emptyDir" and storage.size:
            out.ephemeral = _plus(storage.size, SCRATCH_HEADROOM)
    elif source.kind == "pvc":
        claim = {"claimName": source.claim, "readOnly": True}
        out.volumes.append({"name": SOURCE_VOLUME, "persistentVolumeClaim": claim})
        out.mounts.append({"name": SOURCE_VOLUME, "mountPath": SOURCE_MOUNT, "readOnly": True})
        out.model_arg = f"{SOURCE_MOUNT}/{source.sub_path}" if source.sub_path else SOURCE_MOUNT
        out.env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    elif source.kind == "s3":
        out.args += RUNAI_STREAMER
    return out


def _cache_volume(storage: ModelStorage) -> dict[str, Any]:
    if storage.cache == "hostPath":
        return {"hostPath": {"path": storage.path, "type": "DirectoryOrCreate"}}
    if storage.cache == "persistentVolumeClaim":
        return {"persistentVolumeClaim": {"claimName": storage.claim_name}}
    return {"emptyDir": {"sizeLimit": storage.size} if storage.size else {}}


def _plus(a: str, b: str) -> str:
    """a + b as a quantity: whole Gi when it is one, else bytes."""
    total = (quantity(a) or Fraction(0)) + (quantity(b) or Fraction(0))
    gib = total / 2**30
    return f"{gib.numerator}Gi" if gib.denominator == 1 else str(int(total))


def with_env(model_env: list[dict[str, Any]], env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model's env first; a preset's or the user's var of the same name wins."""
    taken = {var["name"] for var in env}
    return [var for var in model_env if var["name"] not in taken] + env


def with_ephemeral(resources: dict[str, Any], size: str | None) -> dict[str, Any]:
    """The model's ephemeral-storage in requests and limits, unless the role sets either (presets set
    none): half of ours next to the user's half could put the request above the limit."""
    kinds = ("requests", "limits")
    if size is None or any("ephemeral-storage" in (resources.get(k) or {}) for k in kinds):
        return resources
    out = {k: dict(v) for k, v in resources.items()}
    for kind in kinds:
        out.setdefault(kind, {})["ephemeral-storage"] = size
    return out
