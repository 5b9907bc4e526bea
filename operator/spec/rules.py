"""Cross-field rules: CEL for the API server, a Python twin for offline render."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvferry.operator.spec.autoscaling import Autoscaling
from kvferry.operator.spec.constants import (
    ACCELERATOR_FAMILIES,
    DRA_ACCELERATORS,
    EFA_ACCELERATORS,
    KNOWN_KV_HEADS,
    MAX_GROUP_NODES,
    MAX_NAME_LEN,
    MAX_TP,
    MULTI_NODE_ACCELERATORS,
    NEURON_ACCELERATORS,
)
from kvferry.operator.spec.flags import OWNED_FLAGS, SHORT_ALIASES, cel_no_owned_flags, owned_flags_in
from kvferry.operator.spec.model_storage import CEL_RULES as MODEL_RULES
from kvferry.operator.spec.podinputs import (
    QUANTITY_MESSAGE,
    RESERVED_ENV,
    RESERVED_ENV_MESSAGE,
    bad_quantities,
    cel_no_reserved_env,
    cel_quantities,
    reserved_env_in,
)
from kvferry.operator.spec.types import Spec


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
_MULTI_NODE_LIST = "[" + ", ".join(f"'{a}'" for a in MULTI_NODE_ACCELERATORS) + "]"


def _whole_nodes(s: Spec) -> bool:
    """Decode spans whole nodes of a preset that may span nodes, and not too many of them."""
    per_node, tp = MAX_TP[s.accelerator], s.decode.tensor_parallel_size
    multi = s.accelerator in MULTI_NODE_ACCELERATORS
    return multi and tp % per_node == 0 and tp <= per_node * MAX_GROUP_NODES


def _cel_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f"'{a}'" for a in items) + "]"


def _role_preset_fits(s: Spec, role: str) -> bool:
    """A role's own preset is the service's, or of the service's family (ACCELERATOR_FAMILIES)."""
    own = getattr(s, role).accelerator
    return (
        own is None
        or own == s.accelerator
        or any({own, s.accelerator} <= set(f) for f in ACCELERATOR_FAMILIES)
    )


def _role_preset_rule(role: str) -> Rule:
    same_family = " || ".join(
        f"(self.{role}.accelerator in {_cel_list(f)} && self.accelerator in {_cel_list(f)})"
        for f in ACCELERATOR_FAMILIES
    )
    families = "; ".join(" with ".join(f) for f in ACCELERATOR_FAMILIES)
    return Rule(
        f".{role}.accelerator",
        f"!has(self.{role}.accelerator) || self.{role}.accelerator == self.accelerator || {same_family}",
        f"{role}.accelerator may differ from spec.accelerator only within a family whose KV layouts the "
        f"kvferry connector maps ({families}); other mixes share no NIXL backend or cache layout",
        lambda s: _role_preset_fits(s, role),
    )


def _efa_attach_rule(role: str) -> Rule:
    preset = f"(has(self.{role}.accelerator) ? self.{role}.accelerator : self.accelerator)"
    return Rule(
        f".{role}.efaAttach",
        f"self.{role}.efaAttach != 'dra' || {preset} in {_cel_list(DRA_ACCELERATORS)}",
        f"{role}.efaAttach dra is rendered for the GPU presets ({', '.join(DRA_ACCELERATORS)}) only: "
        "the claim pairs NVIDIA GPUs with EFA devices on their PCIe roots; Neuron presets and cpu/none "
        "use devicePlugin",
        lambda s: getattr(s, role).efa_attach != "dra" or s.role_accelerator(role) in DRA_ACCELERATORS,
    )


_P_PRESET = "(has(self.prefill.accelerator) ? self.prefill.accelerator : self.accelerator)"
_D_PRESET = "(has(self.decode.accelerator) ? self.decode.accelerator : self.accelerator)"

RULES: list[Rule] = [
    _role_preset_rule("prefill"),
    _role_preset_rule("decode"),
    *(_efa_attach_rule(role) for role in ("prefill", "decode")),
    Rule(
        ".kvTransfer.connector",
        f"{_P_PRESET} == {_D_PRESET} || self.kvTransfer.connector == 'kvferry'",
        "prefill and decode on different accelerator presets need the kvferry connector (the vllm "
        "connectors need identical KV layouts on both sides)",
        lambda s: (
            s.role_accelerator("prefill") == s.role_accelerator("decode")
            or s.kv_transfer.connector == "kvferry"
        ),
    ),
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
        f"(max per preset: {MAX_TP}); prefill cannot span nodes: decode reaches every prefill "
        "rank through the one address the router passes (the serving pod's), not ranks on other pods",
        lambda s: s.prefill.tensor_parallel_size <= MAX_TP[s.accelerator],
    ),
    Rule(
        ".decode.tensorParallelSize",
        f"self.decode.tensorParallelSize <= {_MAX_TP_MAP}[self.accelerator] || "
        f"(self.accelerator in {_MULTI_NODE_LIST} && "
        f"self.decode.tensorParallelSize % {_MAX_TP_MAP}[self.accelerator] == 0 && "
        f"self.decode.tensorParallelSize <= {_MAX_TP_MAP}[self.accelerator] * {MAX_GROUP_NODES})",
        "decode.tensorParallelSize beyond one node must fill whole nodes: a multiple of the per-node "
        f"maximum, at most {MAX_GROUP_NODES} nodes per replica, on {', '.join(MULTI_NODE_ACCELERATORS)} "
        f"(a leader + workers group per replica, one pod per node; max per node: {MAX_TP})",
        lambda s: s.decode.tensor_parallel_size <= MAX_TP[s.accelerator] or _whole_nodes(s),
    ),
    Rule(
        ".decode.tensorParallelSize",
        f"self.decode.tensorParallelSize <= {_MAX_TP_MAP}[self.accelerator] || "
        "self.kvTransfer.connector == 'kvferry'",
        "decode.tensorParallelSize beyond one node needs kvTransfer.connector kvferry (its decode ranks "
        "each register with prefill from their own pod; the upstream connectors are not known to)",
        lambda s: (
            s.decode.tensor_parallel_size <= MAX_TP[s.accelerator] or s.kv_transfer.connector == "kvferry"
        ),
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

# ---- spec.autoscaling (operator/spec/autoscaling.py) ----


def _as(s: Spec) -> Autoscaling:
    return s.autoscaling or Autoscaling(ttft_seconds=1.0, itl_seconds=1.0)  # unset: rules hold trivially


def _role_bounds(role: str) -> Callable[[Spec], bool]:
    def check(s: Spec) -> bool:
        bounds = getattr(_as(s), role)
        return bool(bounds.min_replicas <= bounds.max_replicas)

    return check


def _ratio_ordered(s: Spec) -> bool:
    r = _as(s).ratio
    return r.min is None or r.max is None or r.min <= r.max


def _ratio_min_reachable(s: Spec) -> bool:
    a = _as(s)
    return a.ratio.min is None or a.prefill.max_replicas >= a.ratio.min * a.decode.min_replicas


def _ratio_max_reachable(s: Spec) -> bool:
    a = _as(s)
    return a.ratio.max is None or a.prefill.min_replicas <= a.ratio.max * a.decode.max_replicas


_AS = "!has(self.autoscaling) || "
_BOTH_RATIOS = "!has(self.autoscaling.ratio.min) || !has(self.autoscaling.ratio.max) || "
RULES += [
    Rule(
        ".autoscaling",
        _AS + "(self.prefill.replicasOwner == 'autoscaler' && self.decode.replicasOwner == 'autoscaler')",
        "autoscaling needs prefill.replicasOwner and decode.replicasOwner set to autoscaler: the planner "
        "then owns both roles' replicas and spec replicas are only the starting size (docs/autoscaling.md)",
        lambda s: (
            s.autoscaling is None
            or (s.prefill.replicas_owner == "autoscaler" and s.decode.replicas_owner == "autoscaler")
        ),
    ),
    *(
        Rule(
            f".autoscaling.{role}.maxReplicas",
            _AS + f"self.autoscaling.{role}.minReplicas <= self.autoscaling.{role}.maxReplicas",
            f"autoscaling.{role}.maxReplicas must be >= autoscaling.{role}.minReplicas",
            _role_bounds(role),
        )
        for role in ("prefill", "decode")
    ),
    Rule(
        ".autoscaling.ratio.max",
        _AS + _BOTH_RATIOS + "self.autoscaling.ratio.min <= self.autoscaling.ratio.max",
        "autoscaling.ratio.max must be >= autoscaling.ratio.min",
        _ratio_ordered,
    ),
    Rule(
        ".autoscaling.ratio.min",
        _AS + "!has(self.autoscaling.ratio.min) || double(self.autoscaling.prefill.maxReplicas) >= "
        "self.autoscaling.ratio.min * double(self.autoscaling.decode.minReplicas)",
        "autoscaling.ratio.min cannot be met: prefill.maxReplicas / decode.minReplicas is below it",
        _ratio_min_reachable,
    ),
    Rule(
        ".autoscaling.ratio.max",
        _AS + "!has(self.autoscaling.ratio.max) || double(self.autoscaling.prefill.minReplicas) <= "
        "self.autoscaling.ratio.max * double(self.autoscaling.decode.maxReplicas)",
        "autoscaling.ratio.max cannot be met: prefill.minReplicas / decode.maxReplicas is above it",
        _ratio_max_reachable,
    ),
]

RULES.append(
    Rule(
        ".placement.queueName",
        "self.placement.gang != 'kueue' || has(self.placement.queueName)",
        "placement.queueName is required when placement.gang is kueue: Kueue admits a pod group through "
        "a LocalQueue of the CR's namespace",
        lambda s: s.placement.gang != "kueue" or bool(s.placement.queue_name),
    )
)

# Root-level rule (self = the whole object): names of children must fit Kubernetes' limits.
NAME_RULE = (
    f"size(self.metadata.name) <= {MAX_NAME_LEN}",
    f"metadata.name must be at most {MAX_NAME_LEN} characters: `<name>-prefill` plus the "
    "StatefulSet revision hash must fit the 63-character label limit",
)


# ---- what a CR hands into its pods verbatim (spec/podinputs.py): quantities, env names ----


def _quantity_rule(path: str, resources: Callable[[Spec], Any]) -> Rule:
    return Rule(
        f".{path}",
        cel_quantities(path),
        f"{path} {QUANTITY_MESSAGE}",
        lambda s: not bad_quantities(resources(s)),
    )


def _env_rule(role: str) -> Rule:
    return Rule(
        f".{role}.env",
        cel_no_reserved_env(f"{role}.env"),
        f"{role}.env {RESERVED_ENV_MESSAGE}",
        lambda s: not reserved_env_in(getattr(s, role).env),
    )


RULES += [
    _quantity_rule("prefill.resources", lambda s: s.prefill.resources),
    _quantity_rule("decode.resources", lambda s: s.decode.resources),
    _quantity_rule("router.resources", lambda s: s.router.resources),
    _env_rule("prefill"),
    _env_rule("decode"),
    Rule(
        ".modelToken.env",
        f"!has(self.modelToken) || !(self.modelToken.env in [{', '.join(repr(n) for n in RESERVED_ENV)}])",
        f"modelToken.env {RESERVED_ENV_MESSAGE}",
        lambda s: s.model_token is None or s.model_token.env not in RESERVED_ENV,
    ),
]

# ---- parsing: the same constraints, offline, with errors naming the field ----


# ---- Neuron presets and KV heads: refuse what the engine cannot start with ----

_NEURON_LIST = _cel_list(NEURON_ACCELERATORS)
_NEURON_NAMES = ", ".join(NEURON_ACCELERATORS)
_KV_HEADS_MAP = "{" + ", ".join(f"'{m}': {h}" for m, h in KNOWN_KV_HEADS.items()) + "}"
_KV_HEADS_TEXT = ", ".join(f"{m} {h}" for m, h in KNOWN_KV_HEADS.items())
_NEURON_FIX = "set kvTransfer: {connector: vllm, mode: pull} (docs/trainium.md)"


def _on_neuron(s: Spec) -> bool:
    return any(s.role_accelerator(r) in NEURON_ACCELERATORS for r in ("prefill", "decode"))


def _heads_split(s: Spec, role: str) -> bool:
    heads = KNOWN_KV_HEADS.get(s.model)
    tp = getattr(s, role).tensor_parallel_size
    return s.kv_transfer.connector != "kvferry" or heads is None or heads % tp == 0


def _heads_rule(role: str) -> Rule:
    return Rule(
        f".{role}.tensorParallelSize",
        f"self.kvTransfer.connector != 'kvferry' || !(self.model in {_KV_HEADS_MAP}) || "
        f"{_KV_HEADS_MAP}[self.model] % self.{role}.tensorParallelSize == 0",
        f"{role}.tensorParallelSize must divide the model's KV heads with kvTransfer.connector kvferry "
        f"(KV heads: {_KV_HEADS_TEXT}): the connector splits whole KV heads over TP ranks and refuses "
        "replicated or uneven ones at start-up; use a tensorParallelSize that divides the KV head count "
        "(at most 8 for 8 KV heads), or kvTransfer.connector vllm",
        lambda s: _heads_split(s, role),
    )


RULES += [
    Rule(
        ".kvTransfer.connector",
        f"!({_P_PRESET} in {_NEURON_LIST} || {_D_PRESET} in {_NEURON_LIST}) || "
        "self.kvTransfer.connector != 'kvferry'",
        f"kvTransfer.connector kvferry cannot start on {_NEURON_NAMES}: it measures KV layouts through the "
        "attention backend's do_kv_cache_update, which vLLM's Neuron backend does not have, and the "
        f"Neuron vLLM images are older than the 0.32 it needs; {_NEURON_FIX}, the upstream NixlConnector "
        "Neuron documents",
        lambda s: not _on_neuron(s) or s.kv_transfer.connector != "kvferry",
    ),
    Rule(
        ".kvTransfer.mode",
        f"!({_P_PRESET} in {_NEURON_LIST} || {_D_PRESET} in {_NEURON_LIST}) || "
        "self.kvTransfer.mode == 'pull'",
        f"kvTransfer.mode must be pull on {_NEURON_NAMES}: Neuron documents the NixlConnector's read "
        "(pull) mode only, and no push connector has run on a Neuron device (docs/verification.md "
        f'"The push path on Trainium"); {_NEURON_FIX}',
        lambda s: not _on_neuron(s) or s.kv_transfer.mode == "pull",
    ),
    _heads_rule("prefill"),
    _heads_rule("decode"),
    Rule(
        ".compileCache.claimName",
        "!has(self.compileCache) || !has(self.compileCache.volume) || "
        "self.compileCache.volume != 'persistentVolumeClaim' || has(self.compileCache.claimName)",
        "compileCache.claimName is required when compileCache.volume is persistentVolumeClaim: name the "
        "PVC (in the CR's namespace) that holds the compiled graphs",
        lambda s: (
            s.compile_cache is None
            or s.compile_cache.volume != "persistentVolumeClaim"
            or bool(s.compile_cache.claim_name)
        ),
    ),
    Rule(
        ".compileCache.path",
        "!has(self.compileCache) || !has(self.compileCache.path) || self.compileCache.path.startsWith('/')",
        "compileCache.path must be an absolute node directory (start with /)",
        lambda s: s.compile_cache is None or s.compile_cache.path.startswith("/"),
    ),
]
RULES += [Rule(*rule) for rule in MODEL_RULES]  # spec.model's URI and spec.modelStorage (model_storage.py)
