"""spec.model's sources render what each medium needs (docs/models.md), P and D alike, and the spec
refuses a download that nothing sized: the matrix hf:// x cache, bare id, pvc://, s3://, image path."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.operator.render import model
from kvferry.operator.render.objects import render
from kvferry.operator.spec import SpecError

from tests.unit.operator.cases import make_inference


def pods(cr: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """role -> pod spec of its StatefulSet."""
    out = {}
    for obj in render(cr).objects:
        if obj["kind"] == "StatefulSet":
            out[obj["metadata"]["labels"]["kvferry.io/role"]] = obj["spec"]["template"]["spec"]
    return out


def vllm(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["containers"][0]


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in vllm(pod)["env"]}


def volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod["volumes"]}


def mounts(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in vllm(pod)["volumeMounts"]}


def p5en(model_uri: str, **storage: Any) -> make_inference:
    b = make_inference("m", accelerator="p5en", model=model_uri)
    return b.set(modelStorage=storage) if storage else b


def test_hf_in_emptydir_is_sized_and_requests_its_ephemeral_storage() -> None:
    for pod in pods(p5en("hf://Qwen/Qwen3-32B", size="64Gi").obj()).values():
        assert vllm(pod)["args"][0] == "Qwen/Qwen3-32B"
        assert env(pod)["HF_HOME"] == f"{model.CACHE_MOUNT}/hf"
        assert volumes(pod)[model.CACHE_VOLUME]["emptyDir"] == {"sizeLimit": "64Gi"}
        assert mounts(pod)[model.CACHE_VOLUME]["mountPath"] == model.CACHE_MOUNT
        res = vllm(pod)["resources"]
        # The model plus the scratch headroom, requested (scheduling) and limited (eviction) alike.
        assert res["requests"]["ephemeral-storage"] == res["limits"]["ephemeral-storage"] == "74Gi"


def test_hf_in_emptydir_without_a_size_is_refused_with_what_to_do() -> None:
    with pytest.raises(SpecError) as err:
        render(p5en("hf://Qwen/Qwen3-32B").obj())
    message = "\n".join(err.value.errors)
    assert "spec.modelStorage.size: modelStorage.size is required" in message
    assert "hostPath or persistentVolumeClaim" in message and "pvc:// or s3://" in message
    render(make_inference("c", model="hf://Qwen/Qwen3-0.6B").obj())  # cpu: the download is small


def test_a_bare_hub_id_renders_as_before_model_uris() -> None:
    for pod in pods(p5en("Qwen/Qwen3-32B").obj()).values():
        assert vllm(pod)["args"][:1] == ["Qwen/Qwen3-32B"]
        assert "Qwen/Qwen3-32B" in vllm(pod)["args"]  # the served name, as before
        assert "ephemeral-storage" not in vllm(pod)["resources"]["requests"]


def test_node_local_cache_is_one_host_directory_for_both_roles() -> None:
    cr = p5en("hf://bigscience/bloom", cache="hostPath", path="/mnt/k8s-disks/0/kvferry-models").obj()
    caches = [volumes(p)[model.CACHE_VOLUME] for p in pods(cr).values()]
    want = {"path": "/mnt/k8s-disks/0/kvferry-models", "type": "DirectoryOrCreate"}
    assert [c["hostPath"] for c in caches] == [want, want]
    assert all("ephemeral-storage" not in vllm(p)["resources"]["requests"] for p in pods(cr).values())


def test_a_shared_cache_claim_must_be_named_and_is_shared() -> None:
    with pytest.raises(SpecError, match="modelStorage.claimName is required"):
        render(p5en("hf://Qwen/Qwen3-32B", cache="persistentVolumeClaim").obj())
    cr = p5en("hf://Qwen/Qwen3-32B", cache="persistentVolumeClaim", claimName="hub-cache").obj()
    claims = [volumes(p)[model.CACHE_VOLUME]["persistentVolumeClaim"] for p in pods(cr).values()]
    assert claims == [{"claimName": "hub-cache"}] * 2


def test_pvc_source_is_mounted_read_only_and_never_downloads() -> None:
    for pod in pods(p5en("pvc://fsx-models/Qwen/Qwen3-32B").obj()).values():
        assert volumes(pod)[model.SOURCE_VOLUME]["persistentVolumeClaim"] == {
            "claimName": "fsx-models",
            "readOnly": True,
        }
        assert mounts(pod)[model.SOURCE_VOLUME] == {
            "name": model.SOURCE_VOLUME,
            "mountPath": model.SOURCE_MOUNT,
            "readOnly": True,
        }
        assert vllm(pod)["args"][0] == f"{model.SOURCE_MOUNT}/Qwen/Qwen3-32B"
        assert env(pod)["HF_HUB_OFFLINE"] == "1" and "HF_HOME" not in env(pod)
        assert vllm(pod)["args"][vllm(pod)["args"].index("--served-model-name") + 1] == "Qwen3-32B"


@pytest.mark.parametrize(
    "uri", ["pvc://Fsx/x", "pvc://fsx/../etc", "pvc://fsx/a/./b", "pvc://fsx/a/..", "s3://B", "hf://"]
)
def test_malformed_uris_are_refused_naming_the_field(uri: str) -> None:
    with pytest.raises(SpecError, match=r"spec\.model: model "):
        render(make_inference("bad", model=uri).obj())


def test_s3_streams_with_runai_and_the_pods_service_account() -> None:
    cr = p5en("s3://my-models/qwen3-32b/", serviceAccountName="model-reader").obj()
    for pod in pods(cr).values():
        args = vllm(pod)["args"]
        assert args[0] == "s3://my-models/qwen3-32b/"
        # vLLM docs, "Loading models with Run:ai Model Streamer": --load-format runai_streamer.
        assert args[args.index("--load-format") + 1] == "runai_streamer"
        assert pod["serviceAccountName"] == "model-reader"
        assert "ephemeral-storage" not in vllm(pod)["resources"]["requests"]
        assert model.CACHE_VOLUME not in volumes(pod)


def test_an_image_path_adds_nothing() -> None:
    for pod in pods(make_inference("p", model="/models/tiny").obj()).values():
        assert vllm(pod)["args"][0] == "/models/tiny"
        assert model.CACHE_VOLUME not in volumes(pod) and model.SOURCE_VOLUME not in volumes(pod)
        assert "HF_HUB_OFFLINE" not in env(pod)


def test_a_users_env_and_ephemeral_storage_win() -> None:
    cr = (
        p5en("hf://Qwen/Qwen3-32B", size="64Gi")
        .prefill(env=[{"name": "HF_HOME", "value": "/elsewhere"}])
        .prefill(resources={"requests": {"ephemeral-storage": "200Gi"}})
        .obj()
    )
    prefill = pods(cr)["prefill"]
    assert env(prefill)["HF_HOME"] == "/elsewhere"
    assert vllm(prefill)["resources"]["requests"]["ephemeral-storage"] == "200Gi"
    assert "ephemeral-storage" not in vllm(prefill)["resources"]["limits"]  # never a limit below it
    assert vllm(pods(cr)["decode"])["resources"]["limits"]["ephemeral-storage"] == "74Gi"
