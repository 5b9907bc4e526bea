"""Fake nodes carry the labels placement renders against: zone, and EKS's network layers on the shapes
EKS labels (p5en, trn2), not on the plain cpu node."""

from __future__ import annotations

from kvferry.local.controlplane import nodes
from kvferry.operator.render.placement import NETWORK_LAYERS, ZONE


def test_the_fake_nodes_use_the_keys_placement_renders() -> None:
    assert {key for key, _ in NETWORK_LAYERS} == set(nodes.NETWORK_LAYERS)
    assert ZONE == nodes.ZONE


def test_two_nodes_share_each_bottom_layer_node_and_one_zone_shares_the_upper_layers() -> None:
    labels = [nodes.manifest(nodes.P5EN, i, zone="z1")["metadata"]["labels"] for i in range(4)]
    bottom = [lab[nodes.NETWORK_LAYERS[2]] for lab in labels]
    assert bottom[0] == bottom[1] != bottom[2] == bottom[3]
    assert len({(lab[nodes.NETWORK_LAYERS[0]], lab[nodes.NETWORK_LAYERS[1]]) for lab in labels}) == 1
    other = nodes.manifest(nodes.TRN2, 0, zone="z2")["metadata"]["labels"]
    assert other[nodes.NETWORK_LAYERS[0]] != labels[0][nodes.NETWORK_LAYERS[0]]


def test_an_explicit_network_wins_and_the_cpu_shape_has_none() -> None:
    body = nodes.manifest(nodes.P5EN, 0, network=("a", "b", "c"))
    assert [body["metadata"]["labels"][k] for k in nodes.NETWORK_LAYERS] == ["a", "b", "c"]
    cpu = nodes.manifest(nodes.CPU, 0)["metadata"]["labels"]
    assert not set(nodes.NETWORK_LAYERS) & set(cpu)
