"""A Node of its own, run by a local NodeAgent (real processes, not kwok): one context manager for the
tests that need pods to run for real."""

from __future__ import annotations

import contextlib
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client
from kvferry.local.controlplane import nodes
from kvferry.local.nodeagent.agent import NodeAgent


@contextlib.contextmanager
def agent_node(
    kubeconfig: Path, api: client.ApiClient, prefix: str, taint: str | None = None, **agent: Any
) -> Iterator[tuple[str, NodeAgent]]:
    """A new Node named `prefix-<hex>` (tainted NoSchedule with `taint` when given) and the agent running
    it (needs root: it creates the node's netns); `agent` goes to NodeAgent (e.g. vllm=[...]). Both are
    gone afterwards."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    body = nodes.manifest(nodes.CPU, 0, kwok=False)
    body["metadata"]["name"] = body["metadata"]["labels"]["kubernetes.io/hostname"] = name
    if taint:
        body["spec"]["taints"] = [{"key": taint, "value": "true", "effect": "NoSchedule"}]
    core = client.CoreV1Api(api)
    core.create_node(body)
    try:
        runner = NodeAgent(str(kubeconfig), name, f"10.213.{random.randint(100, 250)}.0/24", **agent)
        runner.start()
        try:
            yield name, runner
        finally:
            runner.stop()
    finally:
        core.delete_node(name)
