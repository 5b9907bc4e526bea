"""Where a model's weights come from and where they are kept: `spec.model`'s URI and `spec.modelStorage`.

`spec.model` takes the URIs KServe (`storageUri`) and llm-d (`modelArtifacts.uri`) users already write:

- `hf://org/name`, or a bare hub id `org/name` as before: vLLM downloads from the Hugging Face hub
  (token: spec.modelToken) into the cache `modelStorage.cache` names;
- `pvc://claim/path`: the files are on a PersistentVolumeClaim (ReadOnlyMany, e.g. FSx for Lustre),
  mounted read-only; nothing is downloaded;
- `s3://bucket/prefix`: vLLM's Run:ai model streamer reads the weights straight from S3
  (`--load-format runai_streamer`), with the credentials of the pods' service account (IRSA / EKS Pod
  Identity, `modelStorage.serviceAccountName`);
- `/path`: a directory inside the image.

`parse_source` is the one reading of the URI (render and the rules below use it); the CEL twins of
the rules are in CEL_RULES, turned into spec rules by rules.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvferry.operator.spec.constants import EFA_ACCELERATORS
from kvferry.operator.spec.fields import f
from kvferry.operator.spec.quantity import SPEC_MAX_CHARS, SPEC_PATTERN

if TYPE_CHECKING:
    from kvferry.operator.spec.types import Spec

CACHES = ("emptyDir", "hostPath", "persistentVolumeClaim")
DEFAULT_HOST_PATH = "/var/lib/kvferry/models"
# Presets whose nodes have a small root volume and a large model: a download into the pod's ephemeral
# storage must be sized there (EKS node groups default to a ~20 GiB root volume).
SIZED_ACCELERATORS = EFA_ACCELERATORS
# A claim name is a DNS-1123 subdomain; the path under it is relative and never climbs out of it.
PVC_PATTERN = r"^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^/]+)*/?$"
S3_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # hub, pvc, s3, path
    model: str  # what vLLM gets as its model argument, before the mount point is known
    claim: str | None = None  # pvc: the claim
    sub_path: str = ""  # pvc: the folder inside the claim


def parse_source(model: str) -> ModelSource:
    """`spec.model` read as a source (the CRD's rules have refused malformed URIs already)."""
    if model.startswith("hf://"):
        return ModelSource("hub", model.removeprefix("hf://"))
    if model.startswith("pvc://"):
        claim, _, sub = model.removeprefix("pvc://").partition("/")
        return ModelSource("pvc", model, claim=claim, sub_path=sub.strip("/"))
    if model.startswith("s3://"):
        return ModelSource("s3", model)
    if model.startswith("/"):
        return ModelSource("path", model)
    return ModelSource("hub", model)  # a bare hub id, as before model URIs


@dataclass
class ModelStorage:
    """Where the engines keep the model's files, and how large they are."""

    size: str | None = f(
        "Size of the model's files (e.g. 64Gi for Qwen3-32B in bf16). With a hub model cached in "
        "emptyDir it sizes that emptyDir and the pods' ephemeral-storage request and limit; required "
        "for hf:// models there on the p5en, p5, trn2 and trn1 presets (a bare hub id, as before "
        "model URIs, downloads unsized).",
        None,
        maxLength=SPEC_MAX_CHARS,
        pattern=SPEC_PATTERN,
    )
    cache: str = f(
        "Where a hub model (hf:// or a bare id) is downloaded to (HF_HOME). emptyDir: per pod, in the "
        "node's ephemeral storage, downloaded again by every new pod. hostPath: a node directory (put "
        "it on the instance-store NVMe), shared by the prefill and decode pods on that node and kept "
        "across restarts. persistentVolumeClaim: the ReadWriteMany claim `claimName`, shared by every "
        "pod of both roles. Ignored for pvc://, s3:// and image paths, which download nothing.",
        "emptyDir",
        enum=list(CACHES),
    )
    path: str = f(
        "Node directory for cache hostPath (created if missing).",
        DEFAULT_HOST_PATH,
        minLength=2,
        maxLength=4096,
    )
    claim_name: str | None = f(
        "PersistentVolumeClaim in the CR's namespace for cache persistentVolumeClaim.",
        None,
        minLength=1,
        maxLength=253,
    )
    service_account_name: str | None = f(
        "Service account the engine pods run as; for s3:// its IAM role (IRSA or EKS Pod Identity) "
        "grants the S3 read. Unset: the namespace's default.",
        None,
        minLength=1,
        maxLength=253,
    )


def _storage(s: Spec) -> ModelStorage:
    return s.model_storage or ModelStorage()


def _sized(s: Spec) -> bool:
    """An hf:// model downloaded into emptyDir on a sized preset names its size. A bare hub id is
    rendered as before model URIs (an unsized download) so existing CRs stay valid."""
    if not s.model.startswith("hf://") or _storage(s).cache != "emptyDir":
        return True
    presets = {s.role_accelerator("prefill"), s.role_accelerator("decode")}
    return not (presets & set(SIZED_ACCELERATORS)) or _storage(s).size is not None


# No `.` or `..` segment in a pvc:// path (RE2, which CEL's matches() uses, has no lookahead).
_DOT_SEGMENTS = (("contains", "/./"), ("endsWith", "/."), ("contains", "/../"), ("endsWith", "/.."))
_SIZED = "[" + ", ".join(f"'{a}'" for a in SIZED_ACCELERATORS) + "]"
_P = "(has(self.prefill.accelerator) ? self.prefill.accelerator : self.accelerator)"
_D = "(has(self.decode.accelerator) ? self.decode.accelerator : self.accelerator)"
_EMPTY_DIR = (
    "(!has(self.modelStorage) || !has(self.modelStorage.cache) || self.modelStorage.cache == 'emptyDir')"
)

# (field path, CEL with self = spec, message, Python twin): rules.py makes them spec Rules.
CEL_RULES: list[tuple[str, str, str, Callable[[Spec], bool]]] = [
    (
        ".modelStorage.size",
        f"!(self.model.startsWith('hf://') && {_EMPTY_DIR} && ({_P} in {_SIZED} || {_D} in {_SIZED})) || "
        "(has(self.modelStorage) && has(self.modelStorage.size))",
        "modelStorage.size is required: this hf:// model is downloaded into each pod's ephemeral storage "
        "(modelStorage.cache emptyDir), which the pods must request and the node must have; set the "
        "size of the model's files (e.g. 70Gi), or cache it on a hostPath or persistentVolumeClaim, or "
        "serve it from pvc:// or s3://",
        _sized,
    ),
    (
        ".modelStorage.claimName",
        "!has(self.modelStorage) || !has(self.modelStorage.cache) || "
        "self.modelStorage.cache != 'persistentVolumeClaim' || has(self.modelStorage.claimName)",
        "modelStorage.claimName is required when modelStorage.cache is persistentVolumeClaim: name the "
        "ReadWriteMany PVC (in the CR's namespace) that holds the download cache",
        lambda s: _storage(s).cache != "persistentVolumeClaim" or bool(_storage(s).claim_name),
    ),
    (
        ".modelStorage.path",
        "!has(self.modelStorage) || !has(self.modelStorage.path) || self.modelStorage.path.startsWith('/')",
        "modelStorage.path must be an absolute node directory (start with /)",
        lambda s: _storage(s).path.startswith("/"),
    ),
    (
        ".model",
        f"!self.model.startsWith('pvc://') || (self.model.matches('{PVC_PATTERN}') && "
        + " && ".join(f"!self.model.{test}('{dots}')" for test, dots in _DOT_SEGMENTS)
        + ")",
        "model pvc://CLAIM/PATH: CLAIM must be a PersistentVolumeClaim name (lower-case DNS name) and "
        "PATH a folder inside it (no empty, . or .. segments)",
        lambda s: not s.model.startswith("pvc://") or _pvc_ok(s.model),
    ),
    (
        ".model",
        f"!self.model.startsWith('s3://') || self.model.matches('{S3_PATTERN}')",
        "model s3://BUCKET/PREFIX: BUCKET must be an S3 bucket name (3-63 lower-case letters, digits, "
        "dots, hyphens)",
        lambda s: not s.model.startswith("s3://") or re.match(S3_PATTERN, s.model) is not None,
    ),
    (
        ".model",
        "!self.model.startsWith('hf://') || self.model.size() > 5",
        "model hf://ORG/NAME needs the hub id after hf://",
        lambda s: not s.model.startswith("hf://") or len(s.model) > 5,
    ),
]


def _pvc_ok(model: str) -> bool:
    tests = {"contains": str.__contains__, "endsWith": str.endswith}
    return re.match(PVC_PATTERN, model) is not None and not any(
        tests[test](model, dots) for test, dots in _DOT_SEGMENTS
    )
