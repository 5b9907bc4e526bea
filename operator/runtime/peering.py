"""Peering step: the kopf peering object that leader election between operator replicas needs.

kopf only patches a peering object that already exists, and silently runs without one unless peering is
mandatory. So an operator started with a peering name creates it first: a ClusterKopfPeering when it
serves every namespace, a KopfPeering in each namespace it serves otherwise. Creating is idempotent
(an existing object is left as it is); replicas racing to create it all end up sharing one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvferry.operator.reconcile.apply import Kube

log = logging.getLogger("kvferry.operator")


def peering_objects(name: str, namespaces: Sequence[str]) -> list[dict[str, Any]]:
    """The peering objects an operator serving `namespaces` (empty: all) elects its leader through."""
    base = {"apiVersion": "kopf.dev/v1"}
    if not namespaces:
        return [{**base, "kind": "ClusterKopfPeering", "metadata": {"name": name}}]
    return [{**base, "kind": "KopfPeering", "metadata": {"name": name, "namespace": ns}} for ns in namespaces]


def ensure_peering(kube: Kube, name: str, namespaces: Sequence[str]) -> list[str]:
    """Create the missing peering objects; returns what was created ("Kind ns/name")."""
    created = []
    for obj in peering_objects(name, namespaces):
        if kube.create_if_missing(obj):
            meta = obj["metadata"]
            where = f"{meta['namespace']}/" if "namespace" in meta else ""
            created.append(f"{obj['kind']} {where}{meta['name']}")
    for what in created:
        log.info("created %s for leader election", what)
    return created
