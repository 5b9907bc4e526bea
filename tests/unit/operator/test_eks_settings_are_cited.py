"""Every EFA, NCCL, memory-locking and storage setting the p5en preset and the engine image render is
the one docs/eks.md states, and its row there cites a listed source (the pattern of
test_neuron_presets_start.py for Neuron)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kvferry.operator.render import model
from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "eks.md").read_text()
_LINES = (ROOT / "images" / "vllm" / "Dockerfile").read_text().splitlines()
# Instructions only: comments dropped, continuation lines joined.
DOCKERFILE = re.sub(r"\\\n", " ", "\n".join(x for x in _LINES if not x.lstrip().startswith("#")))


def _pods(cr: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["labels"]["kvferry.io/role"]: o["spec"]["template"]["spec"]
        for o in render(cr).objects
        if o["kind"] == "StatefulSet"
    }


def _p5en(model_uri: str = "hf://Qwen/Qwen3-32B", **storage: Any) -> dict[str, dict[str, Any]]:
    b = make_inference("e", accelerator="p5en", model=model_uri).prefill(tensorParallelSize=2)
    return _pods(b.set(modelStorage=storage or {"size": "64Gi"}).obj())


def _c(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["containers"][0]


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in _c(pod)["env"]}


def _image_env(name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", DOCKERFILE)
    assert match, f"images/vllm/Dockerfile sets no {name}"
    return match.group(1)


def _arg(pod: dict[str, Any], flag: str) -> str:
    args = _c(pod)["args"]
    return args[args.index(flag) + 1]


P = _p5en()["prefill"]
REQ, LIM = _c(P)["resources"]["requests"], _c(P)["resources"]["limits"]
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
PVC = _p5en("pvc://fsx/Qwen/Qwen3-32B")["prefill"]
S3 = _p5en("s3://models-bucket/qwen3-32b")["prefill"]

# (fact, the row's setting cell, rendered value, text the row must show)
FACTS: list[tuple[str, str, Any, str]] = [
    ("efa_two_per_gpu_requests_equal_limits", "`vpc.amazonaws.com/efa`",
     (REQ["vpc.amazonaws.com/efa"], LIM["vpc.amazonaws.com/efa"]),
     "TP2 → 4"),
    ("gpu_taint_tolerated_whatever_its_value", "tolerations",
     GPU_TAINT in P["tolerations"], "operator: Exists"),
    ("libfabric_provider_is_efa", "`FI_PROVIDER`", _env(P)["FI_PROVIDER"], "`efa`"),
    ("device_rdma_required", "`FI_EFA_USE_DEVICE_RDMA`", _env(P)["FI_EFA_USE_DEVICE_RDMA"], "`1`"),
    ("no_shm_between_colocated_p_and_d", "`FI_EFA_ENABLE_SHM_TRANSFER`",
     _env(P)["FI_EFA_ENABLE_SHM_TRANSFER"], "`0`"),
    ("no_huge_pages_without_a_hugepage_request", "`FI_EFA_USE_HUGE_PAGE`",
     (_env(P)["FI_EFA_USE_HUGE_PAGE"], not any(k.startswith("hugepages") for k in REQ)),
     "`0`"),
    ("ipc_lock_added_not_privileged", "`IPC_LOCK`",
     (_c(P)["securityContext"]["capabilities"]["add"], _c(P)["securityContext"]["privileged"]), "IPC_LOCK"),
    ("engine_runs_as_uid_0_so_ipc_lock_is_effective", "`runAsUser`",
     (P["securityContext"]["runAsUser"], P["securityContext"]["runAsNonRoot"]), "`0`"),
    ("nccl_loads_the_ofi_net_plugin", "`NCCL_NET_PLUGIN`", _image_env("NCCL_NET_PLUGIN"), "`ofi`"),
    ("ofi_plugin_first_on_the_library_path", "`LD_LIBRARY_PATH`",
     _image_env("LD_LIBRARY_PATH").split(":")[0], "/opt/amazon/ofi-nccl-lib"),
    ("model_download_is_requested_and_limited", "`ephemeral-storage`",
     (_c(P)["resources"]["requests"]["ephemeral-storage"], _c(P)["resources"]["limits"]["ephemeral-storage"]),
     "64Gi → 74Gi"),
    ("download_cache_is_bounded", "model-cache `sizeLimit`",
     {v["name"]: v for v in P["volumes"]}[model.CACHE_VOLUME]["emptyDir"]["sizeLimit"], "64Gi"),
    ("hub_cache_on_the_cache_volume", "`HF_HOME`", _env(P)["HF_HOME"], "/var/cache/kvferry-models/hf"),
    ("pvc_models_never_reach_the_hub", "`HF_HUB_OFFLINE`", _env(PVC)["HF_HUB_OFFLINE"], "`1`"),
    ("pvc_mounted_read_only", "pvc:// `readOnly`",
     ({v["name"]: v for v in PVC["volumes"]}[model.SOURCE_VOLUME]["persistentVolumeClaim"]["readOnly"],
      {m["name"]: m for m in _c(PVC)["volumeMounts"]}[model.SOURCE_VOLUME]),
     "`/mnt/models`"),
    ("s3_streams_with_runai", "`--load-format`", _arg(S3, "--load-format"), "`runai_streamer`"),
]  # fmt: skip
WANT = {
    "efa_two_per_gpu_requests_equal_limits": (4, 4),
    "gpu_taint_tolerated_whatever_its_value": True,
    "libfabric_provider_is_efa": "efa",
    "device_rdma_required": "1",
    "no_shm_between_colocated_p_and_d": "0",
    "no_huge_pages_without_a_hugepage_request": ("0", True),
    "ipc_lock_added_not_privileged": (["IPC_LOCK"], False),
    "engine_runs_as_uid_0_so_ipc_lock_is_effective": (0, False),
    "nccl_loads_the_ofi_net_plugin": "ofi",
    "ofi_plugin_first_on_the_library_path": "/opt/amazon/ofi-nccl-lib",
    "model_download_is_requested_and_limited": ("74Gi", "74Gi"),
    "download_cache_is_bounded": "64Gi",
    "hub_cache_on_the_cache_volume": "/var/cache/kvferry-models/hf",
    "pvc_models_never_reach_the_hub": "1",
    "pvc_mounted_read_only": (
        True,
        {"name": model.SOURCE_VOLUME, "mountPath": model.SOURCE_MOUNT, "readOnly": True},
    ),
    "s3_streams_with_runai": "runai_streamer",
}


@pytest.mark.parametrize(("fact", "setting", "rendered", "shown"), FACTS, ids=[f[0] for f in FACTS])
def test_eks_setting_is_rendered_and_cited(fact: str, setting: str, rendered: Any, shown: str) -> None:
    assert rendered == WANT[fact], fact
    rows = [line for line in DOC.splitlines() if line.startswith(f"| {setting} |")]
    assert rows, f"docs/eks.md has no row for {setting}"
    assert shown in rows[0], (fact, rows[0])
    cited = re.findall(r"\[S(\d+)\]", rows[0])
    assert cited, f"{setting}: no source"
    assert all(f"- [S{n}] " in DOC for n in cited), (setting, cited)


def test_the_image_build_fails_without_the_ofi_plugin() -> None:
    # aws-ofi-nccl's library is libnccl-net-ofi.so; its folder differs by installer version, so the
    # build looks it up and stops when it is missing rather than shipping NCCL over sockets.
    assert "find /opt/amazon -name libnccl-net-ofi.so" in DOCKERFILE
    assert "exit 1" in DOCKERFILE.split("libnccl-net-ofi.so", 2)[2].split("\n", 1)[0]


def test_every_source_is_cited_and_every_citation_listed() -> None:
    listed = set(re.findall(r"^- \[S(\d+)\] ", DOC, flags=re.M))
    used = set(re.findall(r"\[S(\d+)\]", DOC.split("## Sources", 1)[0]))
    assert used == listed, (sorted(used - listed), sorted(listed - used))
