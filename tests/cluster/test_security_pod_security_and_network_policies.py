"""On the real API server: every preset's NetworkPolicies are accepted and stored as rendered, and the
Pod Security Standard level docs/security.md claims for each role is what PodSecurity admission says."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from kvferry.operator.reconcile.drift import is_subset
from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference

pytestmark = pytest.mark.cluster

PRESETS = {
    "p5en": make_inference("sec-p5en", accelerator="p5en").prefill(tensorParallelSize=2),
    "p5": make_inference("sec-p5", accelerator="p5"),
    "trn2": make_inference("sec-trn2", accelerator="trn2")
    .kv(connector="vllm", mode="pull")
    .prefill(tensorParallelSize=16)
    .decode(tensorParallelSize=16),
    "trn1": make_inference("sec-trn1", accelerator="trn1").kv(connector="vllm", mode="pull"),
    "cpu": make_inference("sec-cpu").set(
        networkPolicy={"clients": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]}
    ),
    "none": make_inference("sec-none", accelerator="none", image="registry.example/vllm:1"),
}
# docs/security.md: the strictest level each role's pods meet.
LEVELS = {
    "cpu": {"prefill": "restricted", "decode": "restricted", "router": "restricted"},
    "none": {"prefill": "baseline", "decode": "baseline", "router": "restricted"},
    **{
        p: {"prefill": "privileged", "decode": "privileged", "router": "restricted"}
        for p in ("p5en", "p5", "trn2", "trn1")
    },
}
ORDER = ("restricted", "baseline", "privileged")


def rendered(preset: str, namespace: str) -> list[dict[str, Any]]:
    obj = PRESETS[preset].obj()
    obj["metadata"]["namespace"] = namespace
    return render(obj).objects


def test_network_policies_of_every_preset_are_accepted_as_rendered(control_plane, namespace) -> None:
    for preset in PRESETS:
        policies = [o for o in rendered(preset, namespace) if o["kind"] == "NetworkPolicy"]
        assert len(policies) == 2, preset
        docs = "\n---\n".join(yaml.safe_dump(p) for p in policies)
        control_plane.kubectl("apply", "--server-side", "--field-manager=kvferry", "-f", "-", input=docs)
        for policy in policies:
            name = policy["metadata"]["name"]
            res = control_plane.kubectl("-n", namespace, "get", "networkpolicy", name, "-o", "json")
            stored = json.loads(res.stdout)
            assert is_subset(policy["spec"], stored["spec"]), (preset, name, stored["spec"])


@pytest.fixture
def level_namespaces(admin_api) -> Iterator[dict[str, str]]:
    """One namespace per Pod Security Standard level, enforced by the API server's PodSecurity admission."""
    core = client.CoreV1Api(admin_api)
    suffix = uuid.uuid4().hex[:6]
    made = {}
    try:
        for level in ORDER:
            name = f"pss-{level}-{suffix}"
            labels = {"pod-security.kubernetes.io/enforce": level}
            core.create_namespace({"metadata": {"name": name, "labels": labels}})
            made[level] = name
        yield made
    finally:
        for name in made.values():
            core.delete_namespace(name)


def admitted(control_plane, pod_spec: dict[str, Any], namespace: str) -> tuple[bool, str]:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "namespace": namespace}}
    pod["spec"] = pod_spec
    res = control_plane.kubectl(
        "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False
    )
    return res.returncode == 0, res.stderr


@pytest.mark.parametrize("preset", list(PRESETS))
def test_pod_security_admission_agrees_with_the_documented_level(
    control_plane, level_namespaces, preset: str
) -> None:
    for obj in rendered(preset, "x"):
        if obj["kind"] not in ("StatefulSet", "Deployment"):
            continue
        role = obj["metadata"]["labels"]["kvferry.io/role"]
        spec = obj["spec"]["template"]["spec"]
        if obj["kind"] == "Deployment":
            spec = {**spec, "serviceAccountName": "default"}  # the router's SA exists only with the operator
        want = LEVELS[preset][role]
        for level in ORDER:
            ok, err = admitted(control_plane, spec, level_namespaces[level])
            should = ORDER.index(level) >= ORDER.index(want)
            assert ok == should, f"{preset} {role} under {level}: admitted={ok}, documented {want}\n{err}"
            if not ok:
                assert "violates PodSecurity" in err, err
