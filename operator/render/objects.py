"""Render step: a DisaggregatedInference -> the Kubernetes objects it should own (pure, no API access).

`render(cr)` takes the CR as parsed once at the edge (spec.Inference: typed metadata and spec), merges
presets (presets.py), builds one context per role and fills the templates in templates/. Nothing here
imports kopf or kubernetes, so it runs offline (`kvferry render`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml
from kvferry.contracts import pods, versions
from kvferry.operator.render import (
    dra,
    groups,
    images,
    injection,
    model,
    placement,
    presets,
    routing,
    security,
)
from kvferry.operator.render.presets import PodPlan, merge
from kvferry.operator.spec import GROUP, KIND, VERSION, Inference, Meta, Role, Spec, SpecError, names

DEFAULT_ROUTER_IMAGE = images.operator_image()  # the operator image also holds the router
PRESTOP_SECONDS = 10
GRACE_MARGIN_SECONDS = 15
TEMPLATES = (
    "configmap.yaml.j2",
    "router-rbac.yaml.j2",
    "service-headless.yaml.j2",
    "statefulset.yaml.j2",
    "pdb.yaml.j2",
    "router-deployment.yaml.j2",
    "router-service.yaml.j2",
    "networkpolicy.yaml.j2",
)
ROLE_TEMPLATES = {"service-headless.yaml.j2", "statefulset.yaml.j2", "pdb.yaml.j2"}

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,  # YAML, not HTML
)
# JSON is YAML flow syntax: values land in the templates quoted exactly, whatever they contain.
_env.filters["json"] = lambda value: json.dumps(value, sort_keys=False)


# libyaml's safe loader when PyYAML has it: the pure-Python one was ~95 % of render time (when
# 1,000 CRs render once each on a busy operator). Same safe constructors, same documents.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class Rendered:
    """What one render produces: the objects plus values status and events need."""

    objects: list[dict[str, Any]]
    revision: str
    spec: Spec


def revision_of(spec: Spec, plans: dict[str, PodPlan], injector_image: str) -> str:
    """Hash of everything P and D must agree on; equal hashes mean the router may pair the pods.

    Covers the whole data path: model, engine images, the connector's source (with inject, the
    operator image it is copied from: an operator upgrade must not pair old and new connectors)
    and wire protocol version, KV transfer and shared vLLM settings. TP size, replicas and per-role
    args are left out on purpose: the connector maps across TP sizes, and changing one role's
    extras must not break pairing with the other role.
    """
    kv = asdict(spec.kv_transfer)
    if kv["connector_source"] == "image":
        del kv["connector_source"]  # the default leaves revisions of existing CRs unchanged
    shared: dict[str, Any] = {
        "model": spec.model,
        "served": spec.served_model_name,
        "accelerator": spec.accelerator,
        "images": sorted({plan.image for plan in plans.values()}),
        "kvTransfer": kv,
        "backends": plans["prefill"].backends,
        "vllm": {**asdict(spec.vllm), "block_size": presets.block_size(spec)},  # effective, not as written
    }
    if spec.kv_transfer.connector == "kvferry":
        shared["protocol"] = versions.WIRE_PROTOCOL_VERSION  # the connector's wire protocol
    if spec.kv_transfer.connector_source == "inject":
        shared["injector"] = injector_image
    return names.short_hash(json.dumps(shared, sort_keys=True))


def kv_transfer_config(spec: Spec, role: str, plan: PodPlan, revision: str = "") -> dict[str, Any]:
    """vLLM --kv-transfer-config for one role (docs/contracts.md §3). $(VAR)s are expanded by the kubelet."""
    kt = spec.kv_transfer
    base: dict[str, Any] = {
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": "$(POD_NAME)",
        "kv_buffer_device": plan.buffer_device,
        "kv_load_failure_policy": kt.load_failure_policy,
    }
    if kt.connector == "kvferry":
        extra = {
            "backends": plan.backends,
            "lease_s": kt.lease_seconds,
            "deadline_s": kt.deadline_seconds,
            "side_channel_host": "$(POD_IP)",
            "side_channel_port": kt.side_channel_port,
            "revision": revision,  # the connector rejects peers of another revision
        }
        return {
            "kv_connector": pods.CONNECTOR_CLASS,
            "kv_connector_module_path": pods.CONNECTOR_MODULE,
            **base,
            "kv_connector_extra_config": extra,
        }
    extra = {"backends": plan.backends, "kv_lease_duration": kt.lease_seconds}
    if kt.mode == "push":
        extra["push_registration_timeout"] = kt.deadline_seconds
    connector = "NixlPushConnector" if kt.mode == "push" else "NixlConnector"
    return {"kv_connector": connector, **base, "kv_connector_extra_config": extra}


SHUTDOWN_TIMEOUT_SINCE = (0, 18)  # vLLM's --shutdown-timeout (vllm PR 34730); older vLLM refuses it


def vllm_args(
    spec: Spec, role: str, kv_json: str, shutdown_timeout: int, vllm_version: tuple[int, int] = (99, 0)
) -> list[str]:
    engine = spec.vllm
    rspec: Role = getattr(spec, role)
    source = model.plan(spec)  # spec.model's URI: the argument vLLM gets, a load format (model.py)
    args = [
        source.model_arg,
        "--port",
        str(names.HTTP_PORT),
        "--served-model-name",
        source.served_name,
        "--tensor-parallel-size",
        str(rspec.tensor_parallel_size),
        "--block-size",
        str(presets.block_size(spec)),
        "--dtype",
        engine.dtype,
    ]
    if engine.max_model_len:
        args += ["--max-model-len", str(engine.max_model_len)]
    args.append("--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching")
    if routing.kv_events(spec):
        args += ["--kv-events-config", json.dumps(routing.kv_events_config(), separators=(",", ":"))]
    if vllm_version >= SHUTDOWN_TIMEOUT_SINCE:  # an unknown flag stops vLLM at start-up
        args += ["--shutdown-timeout", str(shutdown_timeout)]
    args += source.args
    args += ["--kv-transfer-config", kv_json]
    return args + engine.extra_args + rspec.extra_args


def role_context(
    spec: Spec, cr_name: str, role: str, plan: PodPlan, revision: str, replicas: int | None
) -> dict[str, Any]:
    rspec = getattr(spec, role)
    kv_config = kv_transfer_config(spec, role, plan, revision)
    nodes = groups.nodes_per_replica(spec, role)
    if nodes > 1:  # one engine across the group: every pod names it after the leader
        kv_config["engine_id"] = groups.engine_id(names.role_name(cr_name, role))
    kv_json = json.dumps(kv_config, separators=(",", ":"))
    default_drain = spec.kv_transfer.lease_seconds + 30 if role == "prefill" else 60
    shutdown = rspec.shutdown_timeout_seconds if rspec.shutdown_timeout_seconds is not None else default_drain
    identity = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # NIXL binds and advertises this address: it must be the pod IP, never localhost or 0.0.0.0.
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(spec.kv_transfer.side_channel_port)},
    ]
    token = security.transfer_token(spec, cr_name, plan)  # the side channel answers only its holders
    if token:
        identity.append(token["env"])
    labels = names.common_labels(cr_name, role)
    source = model.plan(spec)
    return {
        "role": role,
        "name": names.role_name(cr_name, role),
        "labels": {**labels, names.LABEL_REVISION: revision},
        "selector": names.selector_labels(cr_name, role),
        "nodes": nodes,  # > 1: a LeaderWorkerSet group per replica (groups.py)
        # The role's Service (router discovery) lists only pods that serve HTTP: a group's leader.
        "service_selector": {
            **names.selector_labels(cr_name, role),
            **({groups.LABEL_WORKER_INDEX: "0"} if nodes > 1 else {}),
        },
        "pod_labels": {**labels, names.LABEL_REVISION: revision},
        "pod_annotations": {},  # set by render() for spec.placement.gang
        "replicas": replicas,
        "image": plan.image,
        "args": vllm_args(spec, role, kv_json, shutdown, plan.vllm_version),
        "env": identity + security.engine_env(spec, model.with_env(source.env, plan.env)),
        "resources": plan.resources,
        "node_selector": plan.node_selector,
        "tolerations": plan.tolerations,
        "scheduler_name": plan.scheduler_name,
        "image_pull_secrets": [{"name": n} for n in plan.image_pull_secrets],
        # spec.model's volume (pvc://) or download cache (hub), the same for both roles (model.py).
        "model": {"volumes": source.volumes, "mounts": source.mounts},
        "service_account": source.service_account,
        "compile_cache": (
            {
                "mount": plan.compile_cache[0],
                "volume": {"name": presets.COMPILE_CACHE_VOLUME, **plan.compile_cache[1]},
            }
            if plan.compile_cache
            else None
        ),
        "affinity": placement.affinity(spec, cr_name, role),  # the user's, plus spec.placement's terms
        "pod_security": security.engine_pod_security(plan),
        "container_security": security.engine_container_security(plan),
        "scratch_mounts": security.SCRATCH_MOUNTS,
        "shm_size": plan.shm_size,
        "startup_failures": max(3, plan.startup_seconds // 10),
        "prestop_seconds": PRESTOP_SECONDS,
        "grace_seconds": PRESTOP_SECONDS + shutdown + GRACE_MARGIN_SECONDS,
        "side_channel_port": spec.kv_transfer.side_channel_port,
        "kv_events_ports": (
            [
                (pods.PORT_KV_EVENTS, pods.KV_EVENTS_PORT),
                (pods.PORT_KV_EVENTS_REPLAY, pods.KV_EVENTS_REPLAY_PORT),
            ]
            if routing.kv_events(spec)
            else []
        ),
        "kv_transfer_json": kv_json,
        "inject": None,  # set by render() for connectorSource inject (injection.py)
        "transfer_token": token,
        "resource_claim": None,  # set by with_device_claim() for efaAttach dra
    }


def with_device_claim(
    spec: Spec, role: str, ctx: dict[str, Any], plan: PodPlan, namespace: str
) -> dict[str, Any] | None:
    """efaAttach dra: the role's ResourceClaimTemplate (render/dra.py); its pods claim GPUs and EFA from it
    instead of requesting the extended resources. None for devicePlugin."""
    if getattr(spec, role).efa_attach != "dra":
        return None
    try:
        rct = dra.template(ctx["name"], namespace, ctx["labels"], plan.devices, plan.efa)
    except dra.DraError as exc:
        raise SpecError([f"spec.{role}.efaAttach: {exc}"]) from None
    ctx["resource_claim"] = {"name": dra.CLAIM_NAME, "resourceClaimTemplateName": rct["metadata"]["name"]}
    ctx["resources"] = {**dra.without_replaced(plan.resources), "claims": [{"name": dra.CLAIM_NAME}]}
    return rct


def router_mode(spec: Spec) -> str:
    if spec.kv_transfer.connector == "kvferry":
        return "kvferry"
    return f"vllm-{spec.kv_transfer.mode}"


def router_config(spec: Spec, cr_name: str, namespace: str) -> dict[str, Any]:
    """The router's config file (docs/contracts.md §2), discovering pods through the role Services."""
    deadline = spec.kv_transfer.deadline_seconds
    auth = security.router_auth(spec)
    return {
        "listen": {"host": "0.0.0.0", "port": names.HTTP_PORT},
        **({"auth": auth} if auth else {}),
        "mode": router_mode(spec),
        "model": model.served_name(spec),
        "policy": spec.router.policy,
        "deadlines": {"prefill_s": 60, "decode_first_token_s": 60, "transfer_s": deadline, "total_s": 600},
        "routing": routing.routing_config(spec),
        "discovery": {
            "kubernetes": {
                "namespace": namespace,
                "prefill_service": names.role_name(cr_name, "prefill"),
                "decode_service": names.role_name(cr_name, "decode"),
                "revision_label": names.LABEL_REVISION,
                "tp_size": {
                    "prefill": spec.prefill.tensor_parallel_size,
                    "decode": spec.decode.tensor_parallel_size,
                },
                **(
                    {
                        "kv_events_port": pods.KV_EVENTS_PORT,
                        "kv_events_replay_port": pods.KV_EVENTS_REPLAY_PORT,
                    }
                    if routing.kv_events(spec)
                    else {}
                ),
            }
        },
    }


def router_context(spec: Spec, cr_name: str, namespace: str, router_image: str) -> dict[str, Any]:
    config_yaml = yaml.safe_dump(router_config(spec, cr_name, namespace), sort_keys=False)
    return {
        "name": names.router_name(cr_name),
        "service_name": names.service_name(cr_name),
        "labels": names.common_labels(cr_name, "router"),
        "selector": names.selector_labels(cr_name, "router"),
        "replicas": spec.router.replicas,
        "image": spec.router.image or router_image,
        "resources": spec.router.resources,
        "env": security.router_env(spec),
        "pod_security": security.router_pod_security(),
        "container_security": security.router_container_security(),
        "service_type": spec.router.service_type,
        "grace_seconds": spec.kv_transfer.deadline_seconds + 30,  # let streams finish
        "config_yaml": config_yaml,
        "config_hash": names.short_hash(config_yaml),
    }


def leader_worker_set(statefulset: dict[str, Any], nodes: int) -> dict[str, Any]:
    """A role wider than one node: its StatefulSet becomes a LeaderWorkerSet of `nodes` pods per replica."""
    text = _env.get_template("leaderworkerset.yaml.j2").render(lws=groups.context(statefulset, nodes))
    lws: dict[str, Any] = yaml.safe_load(text)
    return lws


def owner_reference(meta: Meta) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta.name,
        "uid": meta.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def render(
    cr: Inference | dict[str, Any],
    *,
    registry: str = images.DEFAULT_REGISTRY,
    router_image: str = "",
    observed_replicas: dict[str, int | None] | None = None,
    operator_namespace: str = security.OPERATOR_NAMESPACE,
) -> Rendered:
    """Desired objects for `cr`. Raises spec.SpecError for a spec the API server would reject.

    cr: the CR as parsed by its handler; a body (tests, bench scripts) is parsed here, at render's door.

    registry: where kvferry's own images come from (presets' engine image, the default router image).
    router_image: the router's (and injector's) image when the CR names none; empty = the operator
    image in `registry`.
    observed_replicas: current StatefulSet replicas per role; used for roles whose replicas belong
    to an autoscaler, so the apply never moves them (None: StatefulSet absent, start at spec value).
    operator_namespace: where the operator runs (its pods are the engines' default metrics readers).
    """
    cr = cr if isinstance(cr, Inference) else Inference.of(cr)
    cr_name, namespace, spec = cr.meta.name, cr.meta.namespace, cr.spec
    observed = observed_replicas or {}
    plans = {role: merge(spec, role, registry) for role in names.ROLES}
    router_image = router_image or images.operator_image(registry)
    injector_image = spec.router.image or router_image  # injection.context's init container image
    revision = revision_of(spec, plans, injector_image)
    roles: list[dict[str, Any]] = []
    claims: list[dict[str, Any]] = []  # ResourceClaimTemplates, created before the pods that claim from them
    for role in names.ROLES:
        rspec = getattr(spec, role)
        current = observed.get(role)
        replicas = current if rspec.replicas_owner == "autoscaler" and current is not None else rspec.replicas
        ctx = role_context(spec, cr_name, role, plans[role], revision, replicas)
        ctx["inject"] = injection.context(spec, plans[role], injector_image)
        claim_template = with_device_claim(spec, role, ctx, plans[role], namespace)
        if claim_template:
            claims.append(claim_template)
        roles.append(ctx)
    pods = sum((r["replicas"] or 0) * r["nodes"] for r in roles)  # spec.placement.gang: one group
    gang_labels, gang_annotations = placement.gang_metadata(spec, cr_name, pods)
    for ctx in roles:
        ctx["pod_labels"] = {**ctx["pod_labels"], **gang_labels}
        ctx["pod_annotations"] = gang_annotations
    context = {
        "namespace": namespace,
        "http_port": names.HTTP_PORT,
        "roles": roles,
        "router": router_context(spec, cr_name, namespace, router_image),
        "config_name": names.config_name(cr_name),
        "config_labels": names.common_labels(cr_name, "config"),
        "config_hash_key": names.ANNOTATION_CONFIG_HASH,
        "netpol": security.network_policy_context(
            spec, cr_name, spec.kv_transfer.side_channel_port, operator_namespace
        ),
    }
    objects: list[dict[str, Any]] = list(claims)
    for template in TEMPLATES:
        for role_ctx in roles if template in ROLE_TEMPLATES else [None]:
            text = _env.get_template(template).render(context, r=role_ctx)
            docs = [doc for doc in yaml.load_all(text, Loader=YAML_LOADER) if doc]
            if role_ctx and role_ctx["nodes"] > 1 and template == "statefulset.yaml.j2":
                docs = [leader_worker_set(sts, role_ctx["nodes"]) for sts in docs]
            objects += docs
    if cr.meta.uid:
        for obj in objects:
            obj["metadata"]["ownerReferences"] = [owner_reference(cr.meta)]
    return Rendered(objects=objects, revision=revision, spec=spec)
