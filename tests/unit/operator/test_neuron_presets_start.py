"""No preset renders what the project knows cannot start, and the Neuron presets render what Neuron
documents: each fact is checked against the rendered pods and against its row in docs/trainium.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvferry.operator.render import presets
from kvferry.operator.render.objects import SHUTDOWN_TIMEOUT_SINCE, render
from kvferry.operator.spec import ACCELERATORS, SpecError
from kvferry.operator.spec.constants import NEURON_ACCELERATORS

from tests.unit.operator.cases import make_inference

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "trainium.md").read_text()
NEURON_KV = {"connector": "vllm", "mode": "pull"}
# Neuron DLC tags AWS lists (docs/trainium.md [S1], [S2]): vLLM 0.16.0 only on py312 / SDK 2.29.0-2.31.1.
AWS_NEURON_TAGS = {
    "0.24.0.1.1.0-neuronx-py313-sdk2.32.0-ubuntu24.04",
    *(f"0.16.0-neuronx-py312-sdk{v}-ubuntu24.04" for v in ("2.29.0", "2.29.1", "2.30.0", "2.31.0", "2.31.1")),
}
NEURON_REPO = "public.ecr.aws/neuron/pytorch-inference-vllm-neuronx"


def builder(preset: str) -> make_inference:
    """The CR a user of `preset` would start from: what the preset documents, TP within one node."""
    b = make_inference(f"p-{preset}", accelerator=preset, model="meta-llama/Llama-3.1-8B-Instruct")
    if preset == "none":
        b.set(image="registry.example/vllm:0.32.0")
    if preset in NEURON_ACCELERATORS:
        b.kv(**NEURON_KV).prefill(tensorParallelSize=4).decode(tensorParallelSize=8)
    elif preset in ("p5en", "p5"):
        b.prefill(tensorParallelSize=2).decode(tensorParallelSize=4)
    return b


def engines(cr: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod spec of each engine role."""
    return {
        o["metadata"]["labels"]["kvferry.io/role"]: o["spec"]["template"]["spec"]
        for o in render(cr).objects
        if o["kind"] == "StatefulSet"
    }


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["containers"][0]["env"]}


def kv_config(pod: dict[str, Any]) -> dict[str, Any]:
    args = pod["containers"][0]["args"]
    config: dict[str, Any] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config


@pytest.mark.parametrize("preset", ACCELERATORS)
def test_preset_renders_nothing_known_not_to_start(preset: str) -> None:
    data = presets.load(preset)
    for role, pod in engines(builder(preset).obj()).items():
        c, env = pod["containers"][0], env_of(pod)
        where = f"{preset}/{role}"
        # The kvferry connector needs a measurable KV layout: never on Neuron.
        if preset in NEURON_ACCELERATORS:
            assert kv_config(pod)["kv_connector"] == "NixlConnector", where
            repo, tag = c["image"].split(":")
            assert (repo, tag in AWS_NEURON_TAGS) == (NEURON_REPO, True), where
        # Flags the image's vLLM does not know stop it at start-up.
        if tuple(data.get("vllmVersion", presets.LATEST_VLLM)) < SHUTDOWN_TIMEOUT_SINCE:
            assert "--shutdown-timeout" not in c["args"], where
        # A probe shorter than vLLM's own wait kills a pod that would have come up.
        probe = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        ready = int(env.get("VLLM_ENGINE_READY_TIMEOUT_S", 0))
        assert probe >= ready >= int(env.get("VLLM_NEURON_COMPILATION_TIMEOUT", 0)), where
        # The EFA provider maps huge pages unless told not to: only where the pod requests them.
        if env.get("FI_PROVIDER") == "efa" and not any(
            k.startswith("hugepages-") for k in c["resources"]["limits"]
        ):
            assert env.get("FI_EFA_USE_HUGE_PAGE") == "0", where
        # A read-only root: every cache directory the env names must lie on a mounted volume.
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        for name in ("VLLM_CACHE_ROOT", "NEURON_COMPILE_CACHE_URL", "HOME"):
            if name in env:
                assert any(env[name].startswith(m) for m in mounts), (where, name)
        # Multi-device Neuron pods need the scheduler extension's scheduler.
        if c["resources"]["limits"].get("aws.amazon.com/neuron", 0) > 1:
            assert pod.get("schedulerName") == "my-scheduler", where


@pytest.mark.parametrize("preset", NEURON_ACCELERATORS)
def test_neuron_presets_refuse_what_cannot_start_or_was_never_run(preset: str) -> None:
    for kv, field in (
        ({"mode": "pull"}, "spec.kvTransfer.connector"),
        ({"connector": "vllm"}, "spec.kvTransfer.mode"),
    ):
        with pytest.raises(SpecError) as err:
            render(make_inference("r", accelerator=preset).kv(**kv).obj())
        assert any(e.startswith(f"{field}:") and "connector: vllm, mode: pull" in e for e in err.value.errors)


def test_kvferry_connector_tp_must_split_a_known_models_kv_heads() -> None:
    qwen = make_inference("h", accelerator="p5en", model="Qwen/Qwen3-32B")  # 8 KV heads
    render(qwen.obj())
    with pytest.raises(SpecError) as err:
        render(
            make_inference("h", accelerator="p5en", model="Qwen/Qwen3-32B")
            .decode(tensorParallelSize=16)
            .obj()
        )
    (msg,) = err.value.errors
    assert msg.startswith("spec.decode.tensorParallelSize:") and "Qwen/Qwen3-32B 8" in msg
    # The upstream connectors handle replicated heads themselves; an unknown model is left to start-up.
    render(
        make_inference("h", model="Qwen/Qwen3-32B").kv(connector="vllm").decode(tensorParallelSize=16).obj()
    )
    render(make_inference("h", accelerator="p5en", model="/models/own").decode(tensorParallelSize=16).obj())


# (fact, the docs/trainium.md row's setting, preset, what the render has, what Neuron documents)
def _trn(preset: str) -> dict[str, dict[str, Any]]:
    return engines(builder(preset).obj())


# fmt: off
FACTS: list[tuple[str, str, str, Any, Any]] = [
    ("trn2_image_is_the_sdk_2_32_vllm_neuron_dlc", "image", "trn2",
     lambda p: p["decode"]["containers"][0]["image"],
     f"{NEURON_REPO}:0.24.0.1.1.0-neuronx-py313-sdk2.32.0-ubuntu24.04"),
    ("trn1_image_is_the_legacy_vllm_0_16_dlc", "image", "trn1",
     lambda p: p["decode"]["containers"][0]["image"],
     f"{NEURON_REPO}:0.16.0-neuronx-py312-sdk2.31.1-ubuntu24.04"),
    ("trn2_runs_the_upstream_nixl_connector", "`kv_connector`", "trn2",
     lambda p: kv_config(p["prefill"])["kv_connector"], "NixlConnector"),
    ("trn2_keeps_kv_in_neuron_device_memory", "`kv_buffer_device`", "trn2",
     lambda p: kv_config(p["decode"])["kv_buffer_device"], "cuda"),
    ("trn1_stages_kv_in_host_memory", "`kv_buffer_device`", "trn1",
     lambda p: kv_config(p["decode"])["kv_buffer_device"], "cpu"),
    ("trn2_transfers_over_libfabric", "`backends`", "trn2",
     lambda p: json.dumps(kv_config(p["decode"])["kv_connector_extra_config"]["backends"]), '["LIBFABRIC"]'),
    ("trn2_example_tp_is_the_tutorials_hybrid_tp", "tensorParallelSize (example)", "trn2",
     lambda p: tuple(p[r]["containers"][0]["args"][6] for r in ("prefill", "decode")), ("4", "8")),
    ("neuron_compile_timeout", "`VLLM_NEURON_COMPILATION_TIMEOUT`", "trn2",
     lambda p: env_of(p["decode"])["VLLM_NEURON_COMPILATION_TIMEOUT"], "2400"),
    ("neuron_execute_model_timeout", "`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`", "trn2",
     lambda p: env_of(p["decode"])["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"], "1200"),
    ("neuron_engine_ready_timeout_covers_the_compile", "`VLLM_ENGINE_READY_TIMEOUT_S`", "trn2",
     lambda p: env_of(p["decode"])["VLLM_ENGINE_READY_TIMEOUT_S"], "5400"),
    ("neuron_startup_probe_covers_both_timeouts", "startup probe budget", "trn2",
     lambda p: str(p["decode"]["containers"][0]["startupProbe"]["failureThreshold"] * 10), "6000"),
    ("neuron_shm_transfer_off_for_colocated_engines", "`FI_EFA_ENABLE_SHM_TRANSFER`", "trn2",
     lambda p: env_of(p["decode"])["FI_EFA_ENABLE_SHM_TRANSFER"], "0"),
    ("neuron_efa_huge_pages_off_without_hugepages", "`FI_EFA_USE_HUGE_PAGE`", "trn1",
     lambda p: env_of(p["decode"])["FI_EFA_USE_HUGE_PAGE"], "0"),
    ("neuron_efa_provider", "`FI_PROVIDER`", "trn2", lambda p: env_of(p["decode"])["FI_PROVIDER"], "efa"),
    ("neuron_compile_cache_root", "`VLLM_CACHE_ROOT`", "trn2",
     lambda p: env_of(p["decode"])["VLLM_CACHE_ROOT"], "/var/cache/neuron/vllm"),
    ("neuronx_cc_persistent_cache", "`NEURON_COMPILE_CACHE_URL`", "trn1",
     lambda p: env_of(p["decode"])["NEURON_COMPILE_CACHE_URL"], "/var/cache/neuron/neuronx-cc"),
    ("neuron_pods_use_the_scheduler_extension", "`schedulerName`", "trn1",
     lambda p: p["decode"]["schedulerName"], "my-scheduler"),
]
# fmt: on


@pytest.mark.parametrize(("fact", "setting", "preset", "get", "want"), FACTS, ids=[f[0] for f in FACTS])
def test_neuron_fact_is_rendered_and_cited(fact: str, setting: str, preset: str, get: Any, want: Any) -> None:
    assert get(_trn(preset)) == want, fact
    rows = [line for line in DOC.splitlines() if line.startswith(f"| {setting} |")]
    assert rows, f"docs/trainium.md has no row for {setting}"
    values = want if isinstance(want, tuple) else (want,)
    assert all(str(v) in rows[0] for v in values), (fact, rows[0])
    cited = re.findall(r"\[S(\d+)\]", rows[0])
    assert cited, f"{setting}: no source"
    assert all(f"- [S{n}] " in DOC for n in cited), (setting, cited)


def test_trn1_omits_the_shutdown_timeout_its_vllm_lacks() -> None:
    pods = _trn("trn1")
    assert all("--shutdown-timeout" not in p["containers"][0]["args"] for p in pods.values())
    assert all("--shutdown-timeout" in p["containers"][0]["args"] for p in _trn("trn2").values())
    # spec.image names another vLLM: the preset's version no longer applies.
    own = engines(builder("trn1").set(image="registry.example/neuron-vllm:0.24").obj())
    assert all("--shutdown-timeout" in p["containers"][0]["args"] for p in own.values())


def test_compile_cache_is_node_local_and_shared_by_both_roles_unless_the_spec_names_another() -> None:
    pods = _trn("trn2")
    volumes = [{v["name"]: v for v in p["volumes"]}["compile-cache"] for p in pods.values()]
    assert (
        volumes[0]
        == volumes[1]
        == {
            "name": "compile-cache",
            "hostPath": {"path": "/var/lib/kvferry/neuron-cache", "type": "DirectoryOrCreate"},
        }
    )
    pvc = engines(
        builder("trn2").set(compileCache={"volume": "persistentVolumeClaim", "claimName": "nc"}).obj()
    )
    assert {v["name"]: v for v in pvc["decode"]["volumes"]}["compile-cache"]["persistentVolumeClaim"] == {
        "claimName": "nc"
    }
    # Presets that compile nothing ahead mount nothing for it.
    gpu = engines(builder("p5en").set(compileCache={"volume": "emptyDir"}).obj())
    assert all("compile-cache" not in {v["name"] for v in p["volumes"]} for p in gpu.values())


def test_role_scheduler_and_pull_secrets_override_the_preset() -> None:
    cr = builder("trn2").prefill(schedulerName="default-scheduler", imagePullSecrets=["regcred"]).obj()
    pods = engines(cr)
    assert (pods["prefill"]["schedulerName"], pods["prefill"]["imagePullSecrets"]) == (
        "default-scheduler",
        [{"name": "regcred"}],
    )
    assert pods["decode"]["schedulerName"] == "my-scheduler" and "imagePullSecrets" not in pods["decode"]
    assert "schedulerName" not in engines(builder("p5en").obj())["decode"]


def test_the_trn2_example_is_the_trn2_golden() -> None:
    example = ROOT / "manifests" / "examples" / "trn2-llama3-8b-1p1d.yaml"
    golden = Path(__file__).parent / "golden" / "trn2" / "input.yaml"
    assert yaml.safe_load(example.read_text()) == yaml.safe_load(golden.read_text())


@pytest.mark.parametrize("preset", NEURON_ACCELERATORS)
def test_neuron_router_mode_matches_the_pull_transfer(preset: str) -> None:
    (cm,) = [o for o in render(builder(preset).obj()).objects if o["kind"] == "ConfigMap"]
    assert yaml.safe_load(cm["data"]["router.yaml"])["mode"] == "vllm-pull"
    (row,) = [line for line in DOC.splitlines() if line.startswith("| transfer mode / router mode |")]
    assert row.count("pull (`vllm-pull`)") == 2 and "[S3]" in row and "[S5]" in row
