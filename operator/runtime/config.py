"""Config step: the operator's settings in one object; each field reads a KVFERRY_* env var or a flag.

Each field's type says what its variable takes (msgspec converts the string and checks msgspec.Meta
bounds; an empty variable counts as unset). docs/operator.md lists these (from `describe()`), so the
table and the code cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from kvferry.operator.render import images

Seconds = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]

# The only fields a metrics URL template may hold (scrape.metrics_urls fills them).
PLACEHOLDERS = frozenset({"pod", "pod_ip", "namespace", "port", "role"})


def check_template(template: str) -> str:
    """`template` if it is an http(s) URL using only PLACEHOLDERS, bare; else ValueError.

    str.format would otherwise run format specs (`{pod:>700000000}` allocates 700 MB) and attribute
    or index lookups (`{pod.__class__}`) on whatever the template says.
    """
    if not template.startswith(("http://", "https://")):
        raise ValueError(f"metrics URL {template!r}: must start with http:// or https://")
    try:
        fields = [
            (name, spec, conv)
            for _, name, spec, conv in string.Formatter().parse(template)
            if name is not None
        ]
    except ValueError as exc:
        raise ValueError(f"metrics URL {template!r}: {exc}") from None
    for name, spec, conv in fields:
        if name not in PLACEHOLDERS or spec or conv:
            raise ValueError(
                f"metrics URL {template!r}: only bare placeholders {sorted(PLACEHOLDERS)} are allowed"
            )
    return template


SHARD_PATTERN = r"^\d{1,4}/\d{1,4}$"


def check_shard(shard: str) -> str:
    """`shard` if it reads i/n with 0 <= i < n; else ValueError naming what is wrong."""
    index, _, count = shard.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise ValueError(f"KVFERRY_SHARD/--shard {shard!r}: must be i/n with 0 <= i < n (e.g. 0/2 and 1/2)")
    return shard


def setting(default: Any, env: str, doc: str) -> Any:
    return field(default=default, metadata={"env": env, "doc": doc})


@dataclass
class OperatorConfig:
    namespaces: tuple[str, ...] = setting(
        (), "KVFERRY_NAMESPACES", "Namespaces to watch (comma-separated); empty = cluster-wide."
    )
    kubeconfig: str = setting(
        "", "KVFERRY_KUBECONFIG", "Kubeconfig file; empty = in-cluster credentials, else KUBECONFIG."
    )
    standalone: bool = setting(
        False, "KVFERRY_STANDALONE", "Run without peering (no leader election); for one replica or tests."
    )
    peering: str = setting(
        "",
        "KVFERRY_PEERING",
        "kopf peering name for leader election between replicas; set = peering required "
        "(install crds/kopf-peerings.yaml). Empty = 'kvferry' if that peering exists.",
    )
    priority: int = setting(
        0, "KVFERRY_PRIORITY", "Peering priority; 0 = random, so identical replicas elect one leader."
    )
    image_registry: Annotated[str, msgspec.Meta(pattern=images.REGISTRY_PATTERN)] = setting(
        images.DEFAULT_REGISTRY,
        "KVFERRY_IMAGE_REGISTRY",
        "Registry of the kvferry images (the chart's image.registry): the p5/p5en presets' engine image "
        "<registry>/vllm and the default router image <registry>/operator.",
    )
    router_image: str = setting(
        "",
        "KVFERRY_ROUTER_IMAGE",
        "Router (and injector) image when a CR sets none; empty = <registry>/operator:<version> (the "
        "operator image holds the router). The chart sets the operator's own image.",
    )
    operator_namespace: str = setting(
        "kvferry-system",
        "KVFERRY_OPERATOR_NAMESPACE",
        "Namespace the operator runs in (the chart sets it): only its pods there may read engine /metrics "
        "by default (NetworkPolicy).",
    )
    metrics_interval: Seconds = setting(
        30.0, "KVFERRY_METRICS_INTERVAL", "Seconds between transfer-metrics scrapes per CR."
    )
    metrics_timeout: Seconds = setting(
        2.0, "KVFERRY_METRICS_TIMEOUT", "Per-pod timeout of a metrics scrape, seconds."
    )
    metrics_url: str = setting(
        "http://{pod_ip}:{port}/metrics",
        "KVFERRY_METRICS_URL",
        "Where engine metrics are read: template with {pod}, {pod_ip}, {namespace}, "
        "{port}, {role} (bare, no format specs). Only the operator's own setting: CRs cannot change it.",
    )
    resync_interval: Seconds = setting(
        300.0,
        "KVFERRY_RESYNC_INTERVAL",
        "Seconds between full reconciles of each CR (catches edits of kinds "
        "without an event handler: PDBs, RBAC).",
    )
    liveness: str = setting(
        "", "KVFERRY_LIVENESS", "host:port for the /healthz liveness endpoint; empty = none."
    )
    metrics_port: Port = setting(
        0, "KVFERRY_METRICS_PORT", "Port of the operator's own /metrics (API requests, reconciles); 0 = off."
    )
    metrics_host: str = setting(
        "0.0.0.0", "KVFERRY_METRICS_HOST", "Address the operator's /metrics binds to."
    )
    shard: Annotated[str, msgspec.Meta(pattern=SHARD_PATTERN)] = setting(
        "0/1",
        "KVFERRY_SHARD",
        "This replica's shard, i/n: it serves the CRs whose namespace/name hashes to i of n "
        "(shard.py). 0/1 = every CR. Sharded replicas run standalone (the chart gives each its own).",
    )
    transfer_source: Annotated[str, msgspec.Meta(pattern="^(router|pods)$")] = setting(
        "router",
        "KVFERRY_TRANSFER_SOURCE",
        "Where transfer status comes from: 'router' = one request per CR to its router's "
        "/kvferry/pool-metrics (the router aggregates its engines), 'pods' = every engine pod's /metrics.",
    )
    pool_metrics_url: str = setting(
        "http://{pod_ip}:{port}/kvferry/pool-metrics",
        "KVFERRY_POOL_METRICS_URL",
        "Where a CR's router serves its pool's metrics: template over one running router pod, same "
        "placeholders as KVFERRY_METRICS_URL.",
    )
    status_interval: Annotated[float, msgspec.Meta(ge=0)] = setting(
        1.0,
        "KVFERRY_STATUS_INTERVAL",
        "Least seconds between two status refreshes of one CR from workload events (the events in "
        "between are folded into one patch).",
    )
    apply_pause_seconds: Annotated[float, msgspec.Meta(ge=0)] = setting(
        0.0,
        "KVFERRY_APPLY_PAUSE_SECONDS",
        "Test hook: sleep between object applies (to kill the operator mid-reconcile). Keep 0 in production.",
    )

    def __post_init__(self) -> None:
        check_template(self.metrics_url)  # fail at start-up, not on every scrape
        check_template(self.pool_metrics_url)
        check_shard(self.shard)

    @property
    def peering_name(self) -> str:
        """The kopf peering replicas elect a leader in: one per shard, so shards never pause each other."""
        base = self.peering or "kvferry"
        index, count = self.shard_of
        return base if count == 1 else f"{base}-shard-{index}-of-{count}"

    @property
    def shard_of(self) -> tuple[int, int]:
        """(index, count) of this replica's shard."""
        index, count = self.shard.split("/")
        return int(index), int(count)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        environ = os.environ if environ is None else environ
        env = {fl.name: fl.metadata["env"] for fl in dataclasses.fields(cls)}
        raw: dict[str, Any] = {name: environ[var] for name, var in env.items() if environ.get(var)}
        if "namespaces" in raw:
            raw["namespaces"] = [part.strip() for part in raw["namespaces"].split(",") if part.strip()]
        try:
            return msgspec.convert(raw, cls, strict=False)  # strict=False: numbers and booleans from text
        except msgspec.ValidationError as exc:
            what, _, path = str(exc).partition(" - at `$.")
            name = path.rstrip("`")
            if name not in env:  # __post_init__'s own message
                raise ValueError(what) from None
            what = re.sub(r"Expected `(\w+)`", r"expected \1", what).replace(", got `str`", "")
            raise ValueError(f"{env[name]}={environ[env[name]]!r}: {what}") from None


def describe() -> list[tuple[str, str, str, str]]:
    """(field, env var, default, doc) rows for docs/operator.md."""
    return [
        (f.name, f.metadata["env"], repr(f.default), f.metadata["doc"])
        for f in dataclasses.fields(OperatorConfig)
    ]
