"""Discovery step: which prefill and decode engines exist right now (static list or EndpointSlices).

Kubernetes discovery reads the EndpointSlices of the two role Services (contracts §2): engine id =
pod name (targetRef.name), side-channel host = endpoint address, ports by name `http` and
`side-channel`, revision = the pod's `kvferry.io/revision` label. Only ready endpoints count. The
kubernetes client is imported lazily, inside this module only, so the router image needs it only
when it runs in a cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvferry.contracts.pods import PORT_HTTP, PORT_SIDE_CHANNEL
from kvferry.router import topology
from kvferry.router.config import Endpoint, KubernetesDiscoveryConfig

NAMED_PORTS = (PORT_HTTP, PORT_SIDE_CHANNEL)  # as the operator names them (docs/contracts.md §3)

log = logging.getLogger(__name__)
# Every API call is bounded: without a timeout a hung API server would hold the discovery thread,
# and so the pool, forever.
API_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Pool:
    """A snapshot of the engines the router may use."""

    prefill: tuple[Endpoint, ...] = ()
    decode: tuple[Endpoint, ...] = ()

    def revisions(self) -> set[str]:
        return {e.revision for e in self.prefill} & {e.revision for e in self.decode}


class Discovery(Protocol):
    """Where the pool comes from: `current()` is read on every request, so it never blocks."""

    def current(self) -> Pool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class StaticDiscovery:
    """A fixed pool from the config file (outside Kubernetes)."""

    def __init__(self, static: dict[str, tuple[Endpoint, ...]]) -> None:
        self._pool = Pool(prefill=static["prefill"], decode=static["decode"])

    def current(self) -> Pool:
        return self._pool

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def endpoints_from_slices(
    slices: list[dict[str, Any]],
    pod_labels: dict[str, dict[str, str]],
    role: str,
    tp_size: int,
    revision_label: str,
    kv_events_ports: tuple[int | None, int | None] = (None, None),
) -> tuple[Endpoint, ...]:
    """EndpointSlices (API dicts, camelCase keys) of one role Service -> ready endpoints, by engine id."""
    found: dict[str, Endpoint] = {}
    for eps in slices:
        ports = {p.get("name"): p.get("port") for p in eps.get("ports") or []}
        http_port, side_port = (ports.get(name) for name in NAMED_PORTS)
        if not http_port or not side_port:
            log.warning("EndpointSlice %s lacks ports named %s and %s", _name(eps), *NAMED_PORTS)
            continue
        for ep in eps.get("endpoints") or []:
            ready = (ep.get("conditions") or {}).get("ready")
            ref = ep.get("targetRef") or {}
            addresses = ep.get("addresses") or []
            if ready is False or ref.get("kind") != "Pod" or not addresses:
                continue
            pod = ref["name"]
            found[pod] = Endpoint(
                role=role,
                url=f"http://{_url_host(addresses[0])}:{http_port}",
                engine_id=pod,
                side_host=addresses[0],
                side_port=int(side_port),
                tp_size=tp_size,
                revision=pod_labels.get(pod, {}).get(revision_label, ""),
                topology=topology.place(ep.get("zone"), pod_labels.get(pod, {})),
                # The pod's own KV-event endpoints (vLLM binds them on every address), when it publishes.
                kv_events=_tcp(addresses[0], kv_events_ports[0]),
                kv_events_replay=_tcp(addresses[0], kv_events_ports[1]) if kv_events_ports[0] else "",
            )
    return tuple(found[k] for k in sorted(found))


def _tcp(address: str, port: int | None) -> str:
    return f"tcp://{_url_host(address)}:{port}" if port else ""


def _name(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", "?"))


class KubernetesDiscovery:
    """Polls the role Services' EndpointSlices and their pods; keeps the last good pool on errors."""

    def __init__(self, cfg: KubernetesDiscoveryConfig, kubeconfig: str | None = None) -> None:
        self.cfg = cfg
        self.kubeconfig = kubeconfig  # None: in-cluster credentials, else $KUBECONFIG
        self._pool = Pool()
        self._task: asyncio.Task[None] | None = None
        self._api: Any = None

    def current(self) -> Pool:
        return self._pool

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            # The client's loaders carry no annotations: typed here, where they are called.
            load_kube: Callable[..., None] = config.load_kube_config
            load_incluster: Callable[..., None] = config.load_incluster_config
            conf = client.Configuration()
            if self.kubeconfig:
                load_kube(config_file=self.kubeconfig, client_configuration=conf)
            else:
                try:
                    load_incluster(client_configuration=conf)
                except config.ConfigException:
                    load_kube(client_configuration=conf)
            api = client.ApiClient(conf)
            self._api = (api, client.DiscoveryV1Api(api), client.CoreV1Api(api))
        return self._api

    def refresh(self) -> Pool:
        """One blocking poll of the API server (runs in a thread)."""
        api, discovery, core = self._client()
        ns = self.cfg.namespace
        pods = core.list_namespaced_pod(
            ns, label_selector=self.cfg.revision_label, _request_timeout=API_TIMEOUT_S
        )
        labels = {p.metadata.name: dict(p.metadata.labels or {}) for p in pods.items}
        roles: dict[str, tuple[Endpoint, ...]] = {}
        for role, service in (("prefill", self.cfg.prefill_service), ("decode", self.cfg.decode_service)):
            selector = f"kubernetes.io/service-name={service}"
            items = discovery.list_namespaced_endpoint_slice(
                ns, label_selector=selector, _request_timeout=API_TIMEOUT_S
            ).items
            slices = [api.sanitize_for_serialization(s) for s in items]
            ports = (self.cfg.kv_events_port, self.cfg.kv_events_replay_port)
            roles[role] = endpoints_from_slices(
                slices, labels, role, self.cfg.tp_size.of(role), self.cfg.revision_label, ports
            )
        return Pool(prefill=roles["prefill"], decode=roles["decode"])

    async def _loop(self) -> None:
        while True:
            try:
                self._pool = await asyncio.to_thread(self.refresh)
            except Exception as exc:  # keep serving with the last good pool; say why
                log.warning("kubernetes discovery failed, keeping last pool: %s", exc)
            await asyncio.sleep(self.cfg.poll_s)

    async def start(self) -> None:
        try:
            self._pool = await asyncio.wait_for(asyncio.to_thread(self.refresh), timeout=30)
        except Exception as exc:
            log.warning("initial kubernetes discovery failed: %s", exc)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def make_discovery(
    static: dict[str, tuple[Endpoint, ...]] | None, kube: KubernetesDiscoveryConfig | None
) -> Discovery:
    if static is not None:
        return StaticDiscovery(static)
    assert kube is not None, "config validation guarantees one discovery source"
    return KubernetesDiscovery(kube)
