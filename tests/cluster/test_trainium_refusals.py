"""On the real API server: what cannot start on Trainium is refused naming the field and the fix, and
what the trn2 example renders (Neuron scheduler, pull secrets, the compile cache's hostPath) is stored
as rendered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kvferry.operator.reconcile.drift import is_subset
from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference

pytestmark = pytest.mark.cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "trn2-llama3-8b-1p1d.yaml"
# (CR, the field the message must name, the fix it must say)
REFUSED = {
    "kvferry-on-trn2": (
        make_inference("nr1", accelerator="trn2").kv(mode="pull"),
        "spec.kvTransfer.connector",
        "connector: vllm, mode: pull",
    ),
    "push-on-trn1": (
        make_inference("nr2", accelerator="trn1").kv(connector="vllm", mode="push"),
        "spec.kvTransfer.mode",
        "connector: vllm, mode: pull",
    ),
    "replicated-kv-heads": (
        make_inference("nr3", accelerator="p5en", model="Qwen/Qwen3-32B").decode(tensorParallelSize=16),
        "spec.decode.tensorParallelSize",
        "Qwen/Qwen3-32B 8",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_start_on_trainium_is_refused_with_field_and_fix(
    control_plane, kvferry_crd, namespace, case: str
) -> None:
    builder, field, fix = REFUSED[case]
    body = builder.obj()
    body["metadata"]["namespace"] = namespace
    res = control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(body), check=False)
    assert res.returncode != 0, f"{case} was accepted"
    assert field in res.stderr and fix in res.stderr, res.stderr


def test_the_trn2_example_and_its_engine_pods_are_stored_as_rendered(
    control_plane, kvferry_crd, namespace
) -> None:
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"]["namespace"] = namespace
    cr["spec"]["prefill"]["imagePullSecrets"] = ["regcred"]
    control_plane.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(cr))
    for sts in (o for o in render(cr).objects if o["kind"] == "StatefulSet"):
        res = control_plane.kubectl(
            "apply", "--server-side", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(sts)
        )
        stored = json.loads(res.stdout)["spec"]["template"]["spec"]
        want = sts["spec"]["template"]["spec"]
        assert stored["schedulerName"] == "my-scheduler"
        assert is_subset(want["volumes"], stored["volumes"]), stored["volumes"]
        assert {"name": "compile-cache", "mountPath": "/var/cache/neuron"} in stored["containers"][0][
            "volumeMounts"
        ]
        if sts["metadata"]["name"].endswith("-prefill"):
            assert stored["imagePullSecrets"] == [{"name": "regcred"}]
