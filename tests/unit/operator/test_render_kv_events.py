"""The engines publish vLLM's KV-cache events exactly when the router routes by prefix (and the engines
keep a prefix cache): vLLM's flag, the named ports, the router's discovery ports and the NetworkPolicy
rule that lets the router (only) reach them all appear together, or none of them does."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from kvferry.contracts import pods
from kvferry.operator.render.objects import render

from tests.unit.operator.cases import make_inference


def _rendered(cr: dict[str, Any]) -> dict[str, Any]:
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render(cr).objects}
    out: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        container = objs[("StatefulSet", f"e-{role}")]["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        flag = args.index("--kv-events-config") if "--kv-events-config" in args else None
        out[role] = {
            "config": None if flag is None else json.loads(args[flag + 1]),
            "ports": {p["name"]: p["containerPort"] for p in container["ports"]},
        }
    router = yaml.safe_load(objs[("ConfigMap", "e-config")]["data"]["router.yaml"])
    out["discovery"] = router["discovery"]["kubernetes"]
    policy = objs.get(("NetworkPolicy", "e-engines"))
    out["router_ports"] = (
        None if policy is None else [p.get("port") for p in policy["spec"]["ingress"][1]["ports"]]
    )
    return out


def test_prefix_aware_routing_turns_on_the_events_the_ports_and_the_router_rule() -> None:
    got = _rendered(make_inference("e").obj())
    for role in ("prefill", "decode"):
        assert got[role]["config"] == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pods.KV_EVENTS_PORT}",
            "replay_endpoint": f"tcp://*:{pods.KV_EVENTS_REPLAY_PORT}",
            "topic": "kv-events",
        }
        assert got[role]["ports"][pods.PORT_KV_EVENTS] == pods.KV_EVENTS_PORT
        assert got[role]["ports"][pods.PORT_KV_EVENTS_REPLAY] == pods.KV_EVENTS_REPLAY_PORT
    # the engines' NetworkPolicy lets the router (the rule that admits it) reach both
    assert got["router_ports"] == [pods.PORT_HTTP, pods.PORT_KV_EVENTS, pods.PORT_KV_EVENTS_REPLAY]
    assert (got["discovery"]["kv_events_port"], got["discovery"]["kv_events_replay_port"]) == (
        pods.KV_EVENTS_PORT,
        pods.KV_EVENTS_REPLAY_PORT,
    )


@pytest.mark.parametrize(
    "change",
    [
        {"router": {"routing": {"kvEvents": False}}},
        {"router": {"routing": {"prefixAware": False}}},
        {"router": {"policy": "round-robin"}},
        {"vllm": {"enablePrefixCaching": False}},
    ],
    ids=["kvEvents-off", "prefixAware-off", "round-robin", "no-prefix-cache"],
)
def test_without_prefix_aware_routing_nothing_is_published(change: dict[str, Any]) -> None:
    cr = make_inference("e").obj()
    for key, value in change.items():
        section = cr["spec"].setdefault(key, {})
        for k, v in value.items():
            section[k] = {**section.get(k, {}), **v} if isinstance(v, dict) else v
    got = _rendered(cr)
    for role in ("prefill", "decode"):
        assert got[role]["config"] is None
        assert set(got[role]["ports"]) == {pods.PORT_HTTP, pods.PORT_SIDE_CHANNEL}
    assert "kv_events_port" not in got["discovery"]
    assert got["router_ports"] == [pods.PORT_HTTP]


def test_every_engine_port_name_is_a_valid_service_port_name() -> None:
    """Kubernetes refuses a container port name over 15 characters (IANA_SVC_NAME), at apply time."""
    got = _rendered(make_inference("e").obj())
    for role in ("prefill", "decode"):
        for name in got[role]["ports"]:
            assert re.fullmatch(r"(?=.{1,15}$)[a-z0-9]+(-[a-z0-9]+)*", name) and re.search("[a-z]", name), (
                name
            )
