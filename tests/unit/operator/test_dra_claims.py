"""spec.<role>.efaAttach dra: the claim each pod gets (render/dra.py); the rule keeping it to GPU presets.

Facts (docs/eks-dra.md): the EFA DRA driver's class efa.networking.k8s.aws and the NVIDIA driver's
gpu.nvidia.com both publish resource.kubernetes.io/pcieRoot; resource.k8s.io/v1 allocates at most 32
devices per claim (AllocationResultsMaxSize in k8s.io/api resource/v1).
"""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.operator.render import dra
from kvferry.operator.render.objects import render
from kvferry.operator.spec import SpecError, parse_spec

from tests.unit.operator.cases import make_inference


def _objects(cr: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render(cr).objects}


def _pod(objects: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    pod: dict[str, Any] = objects[("StatefulSet", name)]["spec"]["template"]["spec"]
    return pod


def test_tp2_on_p5en_claims_each_gpu_with_two_efa_on_its_pcie_root() -> None:
    objects = _objects(
        make_inference("x", accelerator="p5en").prefill(tensorParallelSize=2, efaAttach="dra").obj()
    )
    (rct,) = [o for (kind, _), o in objects.items() if kind == "ResourceClaimTemplate"]
    devices = rct["spec"]["spec"]["devices"]
    counts = {
        r["name"]: (r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in devices["requests"]
    }
    assert counts == {
        "gpu-0": (dra.GPU_CLASS, 1),
        "efa-0": (dra.EFA_CLASS, 2),
        "gpu-1": (dra.GPU_CLASS, 1),
        "efa-1": (dra.EFA_CLASS, 2),
    }
    assert devices["constraints"] == [
        {"requests": ["gpu-0", "efa-0"], "matchAttribute": "resource.kubernetes.io/pcieRoot"},
        {"requests": ["gpu-1", "efa-1"], "matchAttribute": "resource.kubernetes.io/pcieRoot"},
    ]
    pod = _pod(objects, "x-prefill")
    assert pod["resourceClaims"] == [
        {"name": "devices", "resourceClaimTemplateName": rct["metadata"]["name"]}
    ]
    resources = pod["containers"][0]["resources"]
    assert resources["claims"] == [{"name": "devices"}]
    for kind in ("requests", "limits"):  # the claim replaces the device plugins' counts, nothing else
        assert "nvidia.com/gpu" not in resources[kind] and "vpc.amazonaws.com/efa" not in resources[kind]
    assert resources["requests"]["memory"] == "128Gi"
    # decode keeps the device plugins' resources: the choice is per role
    decode = _pod(objects, "x-decode")
    assert "resourceClaims" not in decode
    assert decode["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == 2


def test_a_changed_claim_is_a_new_template_name() -> None:
    """ResourceClaimTemplate specs are immutable: another TP size must not be applied over the old one."""

    def name(tp: int) -> str:
        cr = make_inference("x", accelerator="p5en").prefill(tensorParallelSize=tp, efaAttach="dra").obj()
        return next(n for (kind, n) in _objects(cr) if kind == "ResourceClaimTemplate")

    assert name(2) != name(4)
    assert name(2) == name(2)


def test_uneven_efa_spreads_over_the_gpus_and_a_gpu_without_efa_has_no_constraint() -> None:
    spec = dra.claim_spec(gpus=2, efa=1)["devices"]
    assert [r["name"] for r in spec["requests"]] == ["gpu-0", "efa-0", "gpu-1"]
    assert spec["constraints"] == [{"requests": ["gpu-0", "efa-0"], "matchAttribute": dra.PCIE_ROOT}]
    assert dra.efa_shares(8, 16) == [2] * 8 and dra.efa_shares(3, 4) == [2, 1, 1]


def test_more_devices_than_one_claim_can_hold_is_refused_naming_the_field() -> None:
    cr = make_inference("x", accelerator="p5").prefill(tensorParallelSize=8, efaAttach="dra").obj()  # 8 + 32
    with pytest.raises(SpecError, match=r"spec.prefill.efaAttach: 8 GPUs \+ 32 EFA devices .* 32 devices"):
        render(cr)


@pytest.mark.parametrize("accelerator", ["trn2", "cpu"])
def test_dra_is_refused_off_the_gpu_presets(accelerator: str) -> None:
    cr = make_inference("x", accelerator=accelerator, image="i:1").decode(efaAttach="dra")
    if accelerator == "trn2":
        cr.kv(connector="vllm", mode="pull")
    with pytest.raises(SpecError, match="decode.efaAttach dra is rendered for the GPU presets"):
        parse_spec(cr.obj()["spec"], "x")


def test_device_plugin_is_the_default_and_renders_no_claim() -> None:
    objects = _objects(make_inference("x", accelerator="p5en").obj())
    assert not [k for (k, _) in objects if k == "ResourceClaimTemplate"]
    assert parse_spec(make_inference("x").obj()["spec"], "x").prefill.efa_attach == "devicePlugin"
