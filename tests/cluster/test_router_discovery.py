"""The router's Kubernetes discovery against the real API server, as the router's own ServiceAccount:
the role Services' EndpointSlices (made by the controller-manager from the kwok pods) become the router's
pool, with each pod's revision, and only ready pods; the RBAC the operator renders is enough."""

from __future__ import annotations

import json

import yaml
from kvferry.operator.spec import names
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


def _node(cluster, name: str) -> dict:
    return json.loads(cluster.plane.kubectl("get", "node", name, "-o", "json").stdout)


def test_engine_pods_carry_their_nodes_network_layers_and_the_router_sees_them(cluster, operator) -> None:
    """EKS puts the EC2 network-node labels on nodes only; the operator copies them onto the engine pods
    (operator/reconcile/network.py), the router's discovery reads them as each engine's place, and status says
    which bottom-layer network nodes each role landed on."""
    cluster.apply(make_inference("spine", accelerator="p5en").obj())
    cluster.wait_ready("spine")
    layers = [f"topology.k8s.aws/network-node-layer-{i}" for i in (1, 2, 3)]

    def labelled():
        pods = [
            p for p in cluster.pods("spine") if p["metadata"]["labels"].get(names.LABEL_ROLE) in names.ROLES
        ]
        nodes = {p["metadata"]["name"]: _node(cluster, p["spec"]["nodeName"]) for p in pods}
        done = len(pods) == 2 and all(
            all(
                p["metadata"]["labels"].get(k) == nodes[p["metadata"]["name"]]["metadata"]["labels"][k]
                for k in layers
            )
            for p in pods
        )
        return (pods, nodes) if done else None

    pods, nodes = wait_until(labelled, "both engine pods labelled with their node's network layers")
    for node in nodes.values():
        assert all(node["metadata"]["labels"].get(k) for k in layers), (
            "the plane's p5en nodes carry all three"
        )
    discovery = _discovery(cluster, "spine")
    pool = wait_until(
        lambda: (lambda pl: pl if len(pl.prefill) == len(pl.decode) == 1 else None)(discovery.refresh()),
        "one prefill and one decode endpoint",
    )
    for ep in (*pool.prefill, *pool.decode):
        node = nodes[ep.engine_id]["metadata"]["labels"]
        assert ep.topology == (node["topology.kubernetes.io/zone"], *(node[k] for k in layers)), ep
    placement = wait_until(
        lambda: (cluster.cr("spine").get("status") or {}).get("placement"),
        "status.placement lists the network nodes",
        until=lambda pl: all(pl.get(r, {}).get("networkNodes") for r in names.ROLES),
    )
    for role in names.ROLES:
        mine = [
            nodes[p["metadata"]["name"]]["metadata"]["labels"]
            for p in pods
            if p["metadata"]["labels"][names.LABEL_ROLE] == role
        ]
        assert placement[role]["networkNodes"] == sorted({n[layers[2]] for n in mine}), placement
        # The zone comes from the label the API server copies onto the pod at binding (1.35+).
        assert placement[role]["zones"] == sorted({n["topology.kubernetes.io/zone"] for n in mine}), placement
        assert placement[role]["pods"] == len(mine)
