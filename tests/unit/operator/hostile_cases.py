"""CRs that hand their pods numbers, names or images the operator must bound: the unit tests check
them against spec.parse_spec and render, the cluster tests against the real API server's schema and
CEL rules (so the two stay in step, as cases.py does for the rest)."""

from __future__ import annotations

from typing import Any

from tests.unit.operator.cases import make_inference

DIGEST = "sha256:" + "0123456789abcdef" * 4

# (case id, CR, the field path the error must name)
HOSTILE_INVALID: list[tuple[str, dict[str, Any], str]] = [
    # 10**1000000: half a second of the operator's GIL in drift.quantity; 1e999999999 would be hours
    (
        "cpu-exponent-a-million",
        make_inference("hq1").prefill(resources={"limits": {"cpu": "10e1000000"}}).obj(),
        "spec.prefill.resources",
    ),
    # int32's largest exponent: the API server's own ParseQuantity would build a ~900 MB integer
    (
        "memory-exponent-int32-max",
        make_inference("hq2").decode(resources={"requests": {"memory": "1e2147483647"}}).obj(),
        "spec.decode.resources",
    ),
    (
        "router-cpu-negative",
        make_inference("hq3").router(resources={"limits": {"cpu": "-1"}}).obj(),
        "spec.router.resources",
    ),
    (
        "cpu-not-a-quantity",
        make_inference("hq4").prefill(resources={"requests": {"cpu": "lots"}}).obj(),
        "spec.prefill.resources",
    ),
    (
        "cpu-too-many-digits",
        make_inference("hq5").decode(resources={"limits": {"cpu": "1" * 40}}).obj(),
        "spec.decode.resources",
    ),
    (
        "decode-env-pod-ip",
        make_inference("he1").decode(env=[{"name": "POD_IP", "value": "10.0.0.9"}]).obj(),
        "spec.decode.env",
    ),
    (
        "prefill-env-side-channel-host",
        make_inference("he2").prefill(env=[{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "evil"}]).obj(),
        "spec.prefill.env",
    ),
    (
        "prefill-env-pod-name",
        make_inference("he3").prefill(env=[{"name": "POD_NAME", "value": "other-0"}]).obj(),
        "spec.prefill.env",
    ),
    (
        "model-token-env-pod-ip",
        make_inference("he4", modelToken={"name": "hf", "env": "POD_IP"}).obj(),
        "spec.modelToken.env",
    ),
    # numbers the operator computes with or passes on: bounded both ways
    (
        "ratio-max-huge",
        make_inference("hn1")
        .prefill(replicasOwner="autoscaler")
        .decode(replicasOwner="autoscaler")
        .set(autoscaling={"ttftSeconds": 1.0, "itlSeconds": 0.05, "ratio": {"max": 1e308}})
        .obj(),
        "spec.autoscaling.ratio.max",
    ),
    ("max-model-len-huge", make_inference("hn2").vllm(maxModelLen=2**40).obj(), "spec.vllm.maxModelLen"),
    ("image-with-spaces", make_inference("hi1", image="not an image").obj(), "spec.image"),
    ("image-short-digest", make_inference("hi2", image="vllm/vllm-openai@sha256:abc").obj(), "spec.image"),
    (
        "router-image-md5",
        make_inference("hi3").router(image="kvferry/operator@md5:" + "0" * 32).obj(),
        "spec.router.image",
    ),
]

HOSTILE_VALID: dict[str, dict[str, Any]] = {
    "image-by-digest": make_inference("hv1", image=f"registry.example.com:5000/team/vllm@{DIGEST}")
    .router(image=f"kvferry/operator:0.1.0@{DIGEST}")
    .obj(),
    "quantities-as-people-write-them": make_inference("hv2")
    .prefill(resources={"limits": {"cpu": 4, "memory": "1.5Gi"}, "requests": {"cpu": "500m"}})
    .decode(resources={"requests": {"memory": "1e9", "ephemeral-storage": "10G"}})
    .router(resources={"limits": {"cpu": "2", "memory": "512Mi"}})
    .obj(),
    "env-of-other-names": make_inference("hv3")
    .decode(env=[{"name": "POD_IP_FAMILY", "value": "v4"}, {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}])
    .obj(),
}
