"""Security step: what each rendered pod may do, which Secrets it reads, and who may reach it (pure).

render.py asks this module for securityContexts, the scratch mounts that let vLLM run on a read-only
root, env entries that reference Secrets (values never pass through the operator), and the context of
templates/networkpolicy.yaml.j2. docs/security.md lists each boundary and what enforces it.
"""

from __future__ import annotations

from typing import Any

from kvferry.contracts import pods
from kvferry.operator.render import placement, routing
from kvferry.operator.render.presets import PodPlan
from kvferry.operator.spec import Spec, names

ROUTER_API_KEY_ENV = "KVFERRY_ROUTER_API_KEY"
# vLLM, torch, triton, HF and Neuron write caches; with a read-only root they land in one emptyDir.
SCRATCH_DIR = "/var/cache/kvferry"
SCRATCH_MOUNTS = [("/tmp", "tmp"), ("/var/tmp", "var-tmp"), (SCRATCH_DIR, "home")]
# HOME moves every `~/.cache`, `~/.config`, `~/.triton` write (vLLM, torch, HF hub) into scratch.
SCRATCH_ENV = [{"name": "HOME", "value": SCRATCH_DIR}]
RUNTIME_DEFAULT = {"type": "RuntimeDefault"}
OPERATOR_NAMESPACE = "kvferry-system"  # the chart's documented install namespace (config overrides it)


TRANSFER_TOKEN_VOLUME = "kvferry-transfer-token"


def transfer_token(spec: Spec, cr_name: str, plan: PodPlan) -> dict[str, Any] | None:
    """The CR's transfer token Secret (created by the apply step, never rendered: its data is random)
    as a read-only volume, its mount and the env var that tells the connector where it is; None when
    the kvferry connector is not used. Mode 0400 for engines running as root (the EFA presets); for
    any other UID 0444: the kubelet writes the files as root without an fsGroup, and the pod's UID
    is the image's."""
    if spec.kv_transfer.connector != "kvferry":
        return None
    key = pods.TRANSFER_TOKEN_KEY
    secret = {
        "secretName": names.transfer_token_name(cr_name),
        "items": [{"key": key, "path": key}],
        "defaultMode": 0o400 if plan.run_as_user == 0 else 0o444,
    }
    return {
        "volume": {"name": TRANSFER_TOKEN_VOLUME, "secret": secret},
        "mount": {"name": TRANSFER_TOKEN_VOLUME, "mountPath": pods.TRANSFER_TOKEN_DIR, "readOnly": True},
        "env": {"name": pods.TRANSFER_TOKEN_ENV, "value": f"{pods.TRANSFER_TOKEN_DIR}/{key}"},
    }


def operator_peer(namespace: str) -> dict[str, Any]:
    """The operator's pods (chart labels) in the operator's own namespace: the default metrics reader.

    Only that namespace: a pod carrying the same labels in any other namespace (anyone may label
    their own pods) must not reach the engines' HTTP port, which serves the model API too.
    """
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "kvferry", "app.kubernetes.io/component": "operator"}
        },
    }


def engine_pod_security(plan: PodPlan) -> dict[str, Any]:
    """Pod-level context: RuntimeDefault seccomp always; the preset's UID where it names one.

    EFA presets run as UID 0 whatever the image's USER: libfabric's EFA provider locks the memory it
    registers, the container's RLIMIT_MEMLOCK is the runtime's (8 MiB measured), and an added IPC_LOCK
    is effective only for UID 0 (nvidia-container-toolkit issue 2037; docs/eks.md, memory locking).
    """
    ctx: dict[str, Any] = {"seccompProfile": RUNTIME_DEFAULT}
    if plan.run_as_user == 0:
        ctx |= {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0}
    elif plan.run_as_user is not None:
        ctx |= {"runAsNonRoot": True, "runAsUser": plan.run_as_user, "runAsGroup": plan.run_as_user}
    return ctx


def engine_container_security(plan: PodPlan) -> dict[str, Any]:
    """Container context: drop ALL, add only the preset's capabilities (IPC_LOCK on EFA), no escalation."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if plan.capabilities:
        capabilities["add"] = list(plan.capabilities)
    return {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": capabilities,
    }


def router_pod_security() -> dict[str, Any]:
    """The router image (the operator's) runs as UID 65532: Pod Security Standard `restricted`."""
    return {"runAsNonRoot": True, "seccompProfile": RUNTIME_DEFAULT}


def router_container_security() -> dict[str, Any]:
    return {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def secret_env(name: str, ref_name: str, key: str) -> dict[str, Any]:
    """An env var whose value the kubelet reads from a Secret: the value is in no object we write."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref_name, "key": key}}}


def engine_env(spec: Spec, env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Scratch env first (a preset or user var of the same name wins), the model token last (it wins)."""
    taken = {var["name"] for var in env}
    merged = [var for var in SCRATCH_ENV if var["name"] not in taken] + env
    if token := spec.model_token:
        merged = [var for var in merged if var["name"] != token.env]
        merged.append(secret_env(token.env, token.name, token.key))
    return merged


def router_env(spec: Spec) -> list[dict[str, Any]]:
    ref = spec.router.api_key_secret
    return [secret_env(ROUTER_API_KEY_ENV, ref.name, ref.key)] if ref else []


def router_auth(spec: Spec) -> dict[str, Any] | None:
    """The router config's `auth` block: the key's env var name, never the key."""
    return {"api_key_env": ROUTER_API_KEY_ENV} if spec.router.api_key_secret else None


def referenced_secrets(spec: Spec) -> list[tuple[str, str, str]]:
    """(secret, key, what uses it) for every Secret the rendered pods read; the operator checks they exist."""
    out = []
    if spec.model_token:
        out.append((spec.model_token.name, spec.model_token.key, f"spec.modelToken ({spec.model_token.env})"))
    if spec.router.api_key_secret:
        ref = spec.router.api_key_secret
        out.append((ref.name, ref.key, "spec.router.apiKeySecret"))
    return out


def network_policy_context(
    spec: Spec, cr_name: str, side_channel_port: int, operator_namespace: str = OPERATOR_NAMESPACE
) -> dict[str, Any]:
    """Selectors and peers for templates/networkpolicy.yaml.j2 (rendered only when enabled)."""
    np = spec.network_policy
    engines = placement.engine_selector(cr_name)
    return {
        "enabled": np.enabled,
        "labels": names.common_labels(cr_name, "network-policy"),
        "engines_name": names.fit(f"{cr_name}-engines"),
        "router_name": names.router_name(cr_name),
        "engines_selector": engines,
        "router_selector": {"matchLabels": names.selector_labels(cr_name, "router")},
        "metrics_readers": np.metrics_readers or [operator_peer(operator_namespace)],
        "clients": np.clients,
        "side_channel_port": side_channel_port,
        "kv_events_ports": [pods.PORT_KV_EVENTS, pods.PORT_KV_EVENTS_REPLAY]
        if routing.kv_events(spec)
        else [],
    }
