"""The operator (under its own RBAC) creates each CR's transfer token Secret once, owned by the CR, and
mounts it into both roles; a foreign Secret of that name is refused as a Conflict and left as it is; the
Secret goes away with its CR (garbage collection)."""

from __future__ import annotations

import base64

from kvferry.contracts import pods

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until


def _mounts_token(cluster, sts_name: str, secret_name: str) -> bool:
    pod = cluster.get("statefulset", sts_name)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (vllm,) = [c for c in pod["containers"] if c["name"] == "vllm"]
    mounts = [m for m in vllm["volumeMounts"] if m["mountPath"] == pods.TRANSFER_TOKEN_DIR]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    return (
        len(mounts) == 1
        and mounts[0].get("readOnly") is True
        and volumes[mounts[0]["name"]].get("secret", {}).get("secretName") == secret_name
        and env.get(pods.TRANSFER_TOKEN_ENV) == f"{pods.TRANSFER_TOKEN_DIR}/{pods.TRANSFER_TOKEN_KEY}"
    )


def test_the_token_secret_is_created_owned_mounted_and_collected(cluster, operator) -> None:
    cluster.apply(make_inference("tok").obj())
    secret = wait_until(lambda: cluster.get("secret", "tok-transfer-token"), "the token Secret created")
    uid = cluster.cr("tok")["metadata"]["uid"]
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == uid and owner["controller"] is True and owner["kind"] == "DisaggregatedInference"
    assert secret["immutable"] is True
    token = base64.b64decode(secret["data"][pods.TRANSFER_TOKEN_KEY])
    assert len(base64.b64decode(token)) == 32
    cluster.wait_ready("tok")
    for role in ("prefill", "decode"):
        assert _mounts_token(cluster, f"tok-{role}", "tok-transfer-token"), role
    # Later reconciles (a spec edit) never replace the token.
    cluster.kubectl(
        "patch", "disaggregatedinference", "tok", "--type=merge", "-p", '{"spec":{"router":{"replicas":2}}}'
    )
    wait_until(lambda: cluster.ready("tok"), "tok Ready after the edit")
    again = cluster.get("secret", "tok-transfer-token")
    assert again["metadata"]["uid"] == secret["metadata"]["uid"] and again["data"] == secret["data"]

    cluster.kubectl("delete", "disaggregatedinference", "tok", "--wait=true", "--timeout=30s")
    wait_until(lambda: not cluster.get("secret", "tok-transfer-token"), "the token Secret collected", 90)


def test_a_foreign_secret_of_the_token_name_is_a_conflict_and_left_alone(cluster, operator) -> None:
    cluster.core.create_namespaced_secret(
        cluster.ns, {"metadata": {"name": "theirs-transfer-token"}, "stringData": {"token": "chosen-by-b"}}
    )
    cluster.apply(make_inference("theirs").obj())
    degraded = lambda: cluster.condition("theirs", "Degraded")  # noqa: E731
    wait_until(lambda: degraded().get("reason") == "Conflict", "Degraded=Conflict")
    message = degraded()["message"]
    assert "Secret theirs-transfer-token" in message and "transfer token" in message, message
    assert "delete or rename it" in message, message  # the fix
    assert cluster.condition("theirs", "Ready")["status"] == "False"
    wait_until(lambda: cluster.get("service", "theirs-prefill"), "the CR's other objects applied")
    # no engine pods that would mount a token someone else chose
    assert cluster.get("statefulset", "theirs-prefill") is None
    assert cluster.get("statefulset", "theirs-decode") is None
    stored = cluster.get("secret", "theirs-transfer-token")
    assert not stored["metadata"].get("ownerReferences")
    assert base64.b64decode(stored["data"]["token"]) == b"chosen-by-b"
    cluster.kubectl("delete", "disaggregatedinference", "theirs", "--wait=true", "--timeout=30s")
    assert cluster.get("secret", "theirs-transfer-token")  # not the CR's: never collected with it
