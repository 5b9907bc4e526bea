"""Shared DisaggregatedInference cases: the unit tests check them against spec.parse_spec, the cluster
tests against the real API server's schema and CEL rules (so the two stay in step)."""

from __future__ import annotations

import copy
from typing import Any


class make_inference:  # noqa: N801 - reads as a builder call: make_inference("qwen").decode(replicas=2).obj()
    """Small builder for CR dicts."""

    def __init__(self, name: str = "demo", namespace: str | None = None, **spec: Any):
        self._obj: dict[str, Any] = {
            "apiVersion": "kvferry.io/v1alpha1",
            "kind": "DisaggregatedInference",
            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
            "spec": {"model": "/models/tiny", **spec},
        }

    def set(self, **spec: Any) -> make_inference:
        self._obj["spec"].update(spec)
        return self

    def _part(self, key: str, values: dict[str, Any]) -> make_inference:
        self._obj["spec"].setdefault(key, {}).update(values)
        return self

    def prefill(self, **values: Any) -> make_inference:
        return self._part("prefill", values)

    def decode(self, **values: Any) -> make_inference:
        return self._part("decode", values)

    def kv(self, **values: Any) -> make_inference:
        return self._part("kvTransfer", values)

    def router(self, **values: Any) -> make_inference:
        return self._part("router", values)

    def vllm(self, **values: Any) -> make_inference:
        return self._part("vllm", values)

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj)


def _without_model() -> dict[str, Any]:
    obj = make_inference("no-model").obj()
    del obj["spec"]["model"]
    return obj


# (case id, CR, the field path the error must name)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("prefill-replicas-zero", make_inference("bad1").prefill(replicas=0).obj(), "spec.prefill.replicas"),
    ("decode-replicas-negative", make_inference("bad2").decode(replicas=-1).obj(), "spec.decode.replicas"),
    ("unknown-preset", make_inference("bad3", accelerator="p4d").obj(), "spec.accelerator"),
    ("block-size", make_inference("bad4").vllm(blockSize=17).obj(), "spec.vllm.blockSize"),
    ("cpu-block-16", make_inference("bad17").vllm(blockSize=16).obj(), "spec.vllm.blockSize"),
    ("missing-model", _without_model(), "spec.model"),
    (
        "tp-direction-vllm",
        make_inference("bad6", accelerator="p5en")
        .kv(connector="vllm")
        .prefill(tensorParallelSize=4)
        .decode(tensorParallelSize=2)
        .obj(),
        "spec.decode.tensorParallelSize",
    ),
    ("kvferry-pull", make_inference("bad7").kv(mode="pull").obj(), "spec.kvTransfer.mode"),
    (
        "ucx-on-efa",
        make_inference("bad8", accelerator="p5en").kv(backends=["UCX"]).obj(),
        "spec.kvTransfer.backends",
    ),
    ("libfabric-on-cpu", make_inference("bad9").kv(backends=["LIBFABRIC"]).obj(), "spec.kvTransfer.backends"),
    ("none-without-image", make_inference("bad10", accelerator="none").obj(), "spec.image"),
    (
        "lease-shorter-than-deadline",
        make_inference("bad11").kv(leaseSeconds=10, deadlineSeconds=20).obj(),
        "spec.kvTransfer.leaseSeconds",
    ),
    (
        "owned-flag-in-extra-args",
        make_inference("bad12").decode(extraArgs=["--kv-transfer-config={}"]).obj(),
        "spec.decode.extraArgs",
    ),
    *[
        (f"owned-flag-alias-{i}", make_inference(f"alias{i}").set(**{key: {"extraArgs": args}}).obj(), path)
        for i, (key, args, path) in enumerate(
            [
                ("vllm", ["--kv_transfer_config={}"], "spec.vllm.extraArgs"),
                ("prefill", ["-tp", "8"], "spec.prefill.extraArgs"),
                ("decode", ["-tp=8"], "spec.decode.extraArgs"),
                ("decode", ["-t", "8"], "spec.decode.extraArgs"),
                ("prefill", ["--tensor-parallel", "8"], "spec.prefill.extraArgs"),
                ("vllm", ["--config", "/etc/vllm.yaml"], "spec.vllm.extraArgs"),
                ("decode", ["--kv-transfer-config.engine_id", "x"], "spec.decode.extraArgs"),
                ("prefill", ["--served_model=x"], "spec.prefill.extraArgs"),
                ("decode", ["--port=9000"], "spec.decode.extraArgs"),
                ("vllm", ["--no-enable-prefix-caching"], "spec.vllm.extraArgs"),
            ]
        )
    ],
    (
        "trn1-device-buffer",
        make_inference("bad13", accelerator="trn1").kv(bufferDevice="device").obj(),
        "spec.kvTransfer.bufferDevice",
    ),
    (
        "tp-over-node",
        make_inference("bad14", accelerator="p5en").prefill(tensorParallelSize=16).obj(),
        "spec.prefill.tensorParallelSize",
    ),
    (
        "loadbalancer-without-api-key",
        make_inference("bad18").router(serviceType="LoadBalancer").obj(),
        "spec.router.apiKeySecret",
    ),
    ("unknown-policy", make_inference("bad15").router(policy="random").obj(), "spec.router.policy"),
    ("name-too-long", make_inference("x" * 50).obj(), "metadata.name"),
    (
        "inject-upstream-connector",
        make_inference("bad16").kv(connector="vllm", connectorSource="inject").obj(),
        "spec.kvTransfer.connectorSource",
    ),
    # Roles wider than one node (#20): decode only, whole nodes, at most 8, kvferry connector.
    (
        "decode-tp-part-of-a-node",
        make_inference("bad20", accelerator="p5en").decode(tensorParallelSize=12).obj(),
        "spec.decode.tensorParallelSize",
    ),
    (
        "decode-tp-over-eight-nodes",
        make_inference("bad21", accelerator="p5en").decode(tensorParallelSize=72).obj(),
        "spec.decode.tensorParallelSize",
    ),
    (
        "decode-multi-node-upstream-connector",
        make_inference("bad22", accelerator="p5en").kv(connector="vllm").decode(tensorParallelSize=16).obj(),
        "spec.decode.tensorParallelSize",
    ),
    (
        "decode-multi-node-cpu",
        make_inference("bad23").decode(tensorParallelSize=128).obj(),
        "spec.decode.tensorParallelSize",
    ),
    (
        "placement-unknown",
        make_inference("bad24", placement={"sameZone": "always"}).obj(),
        "spec.placement.sameZone",
    ),
    # Heterogeneous roles (#20): only presets whose KV layouts the connector maps, only with it.
    (
        "prefill-on-cpu-decode-on-p5en",
        make_inference("bad25", accelerator="p5en").prefill(accelerator="cpu").obj(),
        "spec.prefill.accelerator",
    ),
    (
        "decode-on-trn2-prefill-on-p5en",
        make_inference("bad26", accelerator="p5en").decode(accelerator="trn2").obj(),
        "spec.decode.accelerator",
    ),
    # Neuron (trn2, trn1): no kvferry connector, no push; KV heads the kvferry connector cannot split.
    (
        "kvferry-connector-on-trn2",
        make_inference("bad28", accelerator="trn2").kv(mode="pull").obj(),
        "spec.kvTransfer.connector",
    ),
    (
        "kvferry-connector-on-trn1",
        make_inference("bad29", accelerator="trn1").kv(mode="pull").obj(),
        "spec.kvTransfer.connector",
    ),
    (
        "upstream-push-on-trn2",
        make_inference("bad30", accelerator="trn2").kv(connector="vllm", mode="push").obj(),
        "spec.kvTransfer.mode",
    ),
    (
        "kvferry-tp-replicates-kv-heads",
        make_inference("bad31", accelerator="p5en", model="Qwen/Qwen3-32B")
        .decode(tensorParallelSize=16)
        .obj(),
        "spec.decode.tensorParallelSize",
    ),
    (
        "kvferry-tp-splits-kv-heads-unevenly",
        make_inference("bad32", accelerator="p5en", model="Qwen/Qwen3-32B")
        .prefill(tensorParallelSize=3)
        .obj(),
        "spec.prefill.tensorParallelSize",
    ),
    (
        "compile-cache-pvc-without-claim",
        make_inference("bad33", accelerator="trn2", compileCache={"volume": "persistentVolumeClaim"})
        .kv(connector="vllm", mode="pull")
        .obj(),
        "spec.compileCache.claimName",
    ),
    # efaAttach dra pairs NVIDIA GPUs with EFA by PCIe root: GPU presets only (render/dra.py).
    (
        "efa-attach-dra-on-trn2",
        make_inference("bad34", accelerator="trn2")
        .kv(connector="vllm", mode="pull")
        .decode(efaAttach="dra")
        .obj(),
        "spec.decode.efaAttach",
    ),
    (
        "efa-attach-dra-on-cpu",
        make_inference("bad35").prefill(efaAttach="dra").obj(),
        "spec.prefill.efaAttach",
    ),
    (
        "mixed-presets-upstream-connector",
        make_inference("bad27", accelerator="p5en").kv(connector="vllm").decode(accelerator="p5").obj(),
        "spec.kvTransfer.connector",
    ),
    # Model sources (spec/model_storage.py): a download nothing sized, a cache claim unnamed, bad URIs.
    (
        "hf-download-unsized-on-p5en",
        make_inference("bad36", accelerator="p5en", model="hf://Qwen/Qwen3-32B").obj(),
        "spec.modelStorage.size",
    ),
    (
        "model-cache-claim-unnamed",
        make_inference(
            "bad37", model="hf://Qwen/Qwen3-0.6B", modelStorage={"cache": "persistentVolumeClaim"}
        ).obj(),
        "spec.modelStorage.claimName",
    ),
    ("pvc-model-climbs-out", make_inference("bad38", model="pvc://models/../etc").obj(), "spec.model"),
    ("s3-model-bad-bucket", make_inference("bad39", model="s3://B").obj(), "spec.model"),
]

VALID = {
    "minimal": make_inference("ok1").obj(),
    "kvferry-wider-prefill": make_inference("ok2", accelerator="p5en")
    .prefill(tensorParallelSize=4)
    .decode(tensorParallelSize=2)
    .obj(),
    "vllm-push-efa": make_inference("ok3", accelerator="p5")
    .kv(connector="vllm", backends=["LIBFABRIC"])
    .obj(),
    "loadbalancer-with-api-key": make_inference("ok5")
    .router(serviceType="LoadBalancer", apiKeySecret={"name": "router-key", "key": "api-key"})
    .obj(),
    "decode-spans-two-p5en": make_inference("ok6", accelerator="p5en").decode(tensorParallelSize=16).obj(),
    # Neuron: the upstream NixlConnector in pull mode, TP 4 prefill / TP 8 decode (docs/trainium.md).
    "trn2-neuron-documented": make_inference("ok7", accelerator="trn2")
    .kv(connector="vllm", mode="pull")
    .prefill(tensorParallelSize=4, schedulerName="default-scheduler", imagePullSecrets=["regcred"])
    .decode(tensorParallelSize=8)
    .set(compileCache={"volume": "persistentVolumeClaim", "claimName": "neuron-cache"})
    .obj(),
    "prefill-p5en-decode-p5": make_inference("ok9", accelerator="p5en").decode(accelerator="p5").obj(),
    "efa-attach-dra-on-p5en-and-p5": make_inference("ok10", accelerator="p5en")
    .prefill(tensorParallelSize=2, efaAttach="dra")
    .decode(accelerator="p5", efaAttach="dra")
    .obj(),
    "placement-required": make_inference(
        "ok8", placement={"sameZone": "required", "networkTopology": "none"}
    ).obj(),
    # Flags near owned ones but not theirs: a prefix rule must not catch them.
    "unowned-extra-args": make_inference("ok4")
    .vllm(extraArgs=["--config-format=hf", "-O3", "--max-num-seqs=64", "--enforce-eager"])
    .prefill(extraArgs=["--gpu-memory-utilization", "0.9", "-q", "fp8"])
    .obj(),
}
