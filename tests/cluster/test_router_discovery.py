"""The router's Kubernetes discovery against the real API server, as the router's own ServiceAccount:
the role Services' EndpointSlices (made by the controller-manager from the kwok pods) become the router's
pool, with each pod's revision, and only ready pods; the RBAC the operator renders is enough."""

from __future__ import annotations

import yaml
from kvferry.operator import names
from kvferry.router.config import parse_config
from kvferry.router.discovery import KubernetesDiscovery

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until


def _discovery(cluster, cr_name: str) -> KubernetesDiscovery:
    cm = cluster.get("configmap", f"{cr_name}-config")
    cfg = parse_config(yaml.safe_load(cm["data"]["router.yaml"]))
    sa = cluster.plane.sa_kubeconfig(cluster.ns, names.router_name(cr_name), create=False)
    return KubernetesDiscovery(cfg.kubernetes, kubeconfig=str(sa))


def test_router_discovers_ready_pods_with_their_revision_as_its_service_account(cluster, operator) -> None:
    cluster.apply(make_inference("disc").prefill(replicas=2).decode(replicas=1).obj())
    cluster.wait_ready("disc")
    cr = cluster.cr("disc")
    revision, side_port = cr["status"]["revision"], cr["spec"]["kvTransfer"]["sideChannelPort"]
    discovery = _discovery(cluster, "disc")

    def full_pool():
        pool = discovery.refresh()
        return pool if (len(pool.prefill), len(pool.decode)) == (2, 1) else None

    pool = wait_until(full_pool, "2 prefill and 1 decode endpoints from the EndpointSlices")
    pods = {p["metadata"]["name"]: p for p in cluster.pods("disc")}
    for ep in (*pool.prefill, *pool.decode):
        pod = pods[ep.engine_id]  # the engine id is the pod name, as the connector's is
        ip = pod["status"]["podIP"]
        assert (ep.side_host, ep.url) == (ip, f"http://{ip}:{names.HTTP_PORT}")
        assert ep.side_port == side_port and ep.revision == revision
    assert [ep.engine_id for ep in pool.prefill] == ["disc-prefill-0", "disc-prefill-1"]
    assert pool.revisions() == {revision}
