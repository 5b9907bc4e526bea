"""Render: both roles mount the CR's transfer token Secret read-only and tell the connector where it is;
the Secret itself (random data) is never rendered, so a render stays pure and repeatable."""

from __future__ import annotations

import pytest
from kvferry.contracts import pods
from kvferry.operator.reconcile import token
from kvferry.operator.render.objects import render
from kvferry.operator.spec import Inference, names
from kvferry.operator.spec.podinputs import reserved_env_in

from tests.unit.operator.cases import make_inference


def _pod(objects: list[dict], name: str) -> dict:
    sts = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == name)
    return sts["spec"]["template"]["spec"]


@pytest.mark.parametrize(("accelerator", "mode"), [("cpu", 0o444), ("p5en", 0o400)])
def test_both_roles_mount_the_token_read_only(accelerator: str, mode: int) -> None:
    cr = make_inference("t", accelerator=accelerator).obj()
    objects = render(cr).objects
    assert render(cr).objects == objects  # nothing random in a render
    assert not [o for o in objects if o["kind"] == "Secret"]
    for role in names.ROLES:
        pod = _pod(objects, names.role_name("t", role))
        volume = next(v for v in pod["volumes"] if v.get("secret"))
        assert volume["secret"] == {
            "secretName": "t-transfer-token",
            "items": [{"key": pods.TRANSFER_TOKEN_KEY, "path": pods.TRANSFER_TOKEN_KEY}],
            "defaultMode": mode,  # 0400 for root (EFA presets), else readable by the image's UID
        }
        vllm = pod["containers"][0]
        mount = next(m for m in vllm["volumeMounts"] if m["name"] == volume["name"])
        assert mount == {"name": volume["name"], "mountPath": pods.TRANSFER_TOKEN_DIR, "readOnly": True}
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        assert env[pods.TRANSFER_TOKEN_ENV] == f"{pods.TRANSFER_TOKEN_DIR}/{pods.TRANSFER_TOKEN_KEY}"


def test_the_upstream_connector_gets_no_token() -> None:
    objects = render(make_inference("u").kv(connector="vllm").obj()).objects
    for role in names.ROLES:
        pod = _pod(objects, names.role_name("u", role))
        assert not [v for v in pod["volumes"] if v.get("secret")]
        assert pods.TRANSFER_TOKEN_ENV not in {e["name"] for e in pod["containers"][0]["env"]}


def test_a_role_cannot_point_the_connector_at_another_file() -> None:
    assert reserved_env_in([{"name": pods.TRANSFER_TOKEN_ENV, "value": "/tmp/mine"}]) == [
        pods.TRANSFER_TOKEN_ENV
    ]


def test_the_secret_is_random_owned_by_the_cr_and_immutable() -> None:
    body = make_inference("t", namespace="ns").obj()
    body["metadata"]["uid"] = "cr-uid"
    cr = Inference.of(body)
    one, two = token.secret(cr), token.secret(cr)
    assert one["stringData"] != two["stringData"]  # a fresh token each time one is created
    assert len(one["stringData"][pods.TRANSFER_TOKEN_KEY]) == 44  # 32 bytes, base64
    assert one["immutable"] is True and one["metadata"]["name"] == "t-transfer-token"
    (owner,) = one["metadata"]["ownerReferences"]
    assert owner["uid"] == "cr-uid" and owner["controller"] is True
