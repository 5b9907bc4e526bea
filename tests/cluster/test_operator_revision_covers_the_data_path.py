"""On the real API server, an inject-mode CR's stored prefill and decode StatefulSets and its config carry
one revision that moves when the injector image (the operator's own image setting) or the connector's
wire protocol version changes, and stays put on a plain re-reconcile: the router pairs pods by that
revision, so an operator upgrade never pairs old and new connectors.

The reconcile runs in the test process (the operator's code and ServiceAccount), so the protocol version
can be changed in between; no operator process runs.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from kvferry.contracts import versions
from kvferry.operator.reconcile import steps
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.spec import Inference, names

from tests.cluster.operator_fixtures import OPERATOR_NAMESPACE
from tests.unit.operator.cases import make_inference

NAME = "inj"
OLD, NEW = "registry.example/kvferry/operator:0.1.0", "registry.example/kvferry/operator:0.2.0"


def _reconcile(cluster, kube, injector: str) -> str:
    cfg = OperatorConfig(router_image=injector, operator_namespace=OPERATOR_NAMESPACE)
    out = steps.reconcile(kube, Inference.of(cluster.cr(NAME)), cfg, trigger="update")
    assert not (out.failed or out.conflict or out.invalid), out
    return cluster.cr(NAME)["status"]["revision"]


def _stored(cluster) -> dict[str, Any]:
    """Every revision the stored objects carry, by where it is read, plus what must follow it."""
    found: dict[str, Any] = {}
    config = cluster.get("configmap", names.config_name(NAME))["data"]
    for role in names.ROLES:
        sts = cluster.get("statefulset", names.role_name(NAME, role))
        pod = sts["spec"]["template"]
        vllm = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")
        kv = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
        found[f"{role} StatefulSet label"] = sts["metadata"]["labels"][names.LABEL_REVISION]
        found[f"{role} pod label"] = pod["metadata"]["labels"][names.LABEL_REVISION]  # the router pairs by it
        found[f"{role} connector"] = kv["kv_connector_extra_config"]["revision"]  # peers of others refused
        stored_kv = json.loads(config[f"{role}-kv-transfer.json"])
        found[f"{role} config"] = stored_kv["kv_connector_extra_config"]["revision"]
        found[f"{role} injector"] = pod["spec"]["initContainers"][0]["image"]
        found[f"{role} generation"] = sts["metadata"]["generation"]
    router = yaml.safe_load(config["router.yaml"])["discovery"]["kubernetes"]
    found["router reads"] = router["revision_label"]
    return found


def _one_revision(stored: dict[str, Any], status_revision: str) -> str:
    revisions = {k: v for k, v in stored.items() if k.endswith(("label", "connector", "config"))}
    assert set(revisions.values()) == {status_revision}, revisions
    assert stored["router reads"] == names.LABEL_REVISION
    return status_revision


def test_revision_moves_with_the_injector_and_the_wire_protocol_only(
    cluster, operator_kube, monkeypatch
) -> None:
    cr = make_inference(NAME, accelerator="p5en", image="vllm/vllm-openai:v0.32.0")
    cluster.apply(cr.kv(connectorSource="inject").obj())

    rev1 = _reconcile(cluster, operator_kube, OLD)
    before = _stored(cluster)
    _one_revision(before, rev1)
    assert before["prefill injector"] == before["decode injector"] == OLD

    # A plain re-reconcile: the same revision, and nothing rolls (generations stay).
    assert _reconcile(cluster, operator_kube, OLD) == rev1
    assert _stored(cluster) == before

    # An operator upgrade: the injected connector comes from the new image.
    rev2 = _reconcile(cluster, operator_kube, NEW)
    upgraded = _stored(cluster)
    _one_revision(upgraded, rev2)
    assert rev2 != rev1 and upgraded["prefill injector"] == upgraded["decode injector"] == NEW

    # A connector whose wire protocol changed (the version in kvferry.contracts).
    monkeypatch.setattr(versions, "WIRE_PROTOCOL_VERSION", versions.WIRE_PROTOCOL_VERSION + 1)
    rev3 = _reconcile(cluster, operator_kube, NEW)
    _one_revision(_stored(cluster), rev3)
    assert rev3 not in (rev1, rev2)
    assert _reconcile(cluster, operator_kube, NEW) == rev3
