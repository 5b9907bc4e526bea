"""What each rendered pod may do, which Secrets it reads and who may reach it (docs/security.md).

The Pod Security Standard levels claimed in docs/security.md are checked here with a small twin of the
admission rules that matter for these pods, and on the real API server by
tests/cluster/test_security_pod_security_and_network_policies.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from kvferry.operator.render import security
from kvferry.operator.render.objects import render
from kvferry.operator.spec import EFA_ACCELERATORS, SpecError, parse_spec
from kvferry.operator.spec.constants import NEURON_ACCELERATORS
from kvferry.operator.status import conditions as status

from tests.unit.operator.cases import make_inference

PRESETS = ("p5en", "p5", "trn2", "trn1", "cpu", "none")
# Capabilities the baseline level allows adding (Pod Security Standards, "Capabilities").
BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip


def cr(preset: str, **spec: Any) -> dict[str, Any]:
    image = {"image": "registry.example/vllm:1"} if preset == "none" else {}
    if preset in NEURON_ACCELERATORS:  # Neuron runs the upstream connector in pull mode only
        spec = {"kvTransfer": {"connector": "vllm", "mode": "pull"}, **spec}
    return make_inference(f"s-{preset}", namespace="ns", accelerator=preset, **image, **spec).obj()


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def pods(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod specs by role (prefill, decode, router)."""
    out = {}
    for obj in by_kind(objs, "StatefulSet") + by_kind(objs, "Deployment"):
        out[obj["metadata"]["labels"]["kvferry.io/role"]] = obj["spec"]["template"]["spec"]
    return out


def pss_level(pod: dict[str, Any]) -> str:
    """The strictest Pod Security Standard level `pod` meets (only the checks these pods can trip)."""
    containers = pod["containers"] + pod.get("initContainers", [])
    ctxs = [c.get("securityContext", {}) for c in containers]
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        return "privileged"
    if any(v.get("hostPath") for v in pod.get("volumes", [])):
        return "privileged"
    if any(c.get("privileged") for c in ctxs):
        return "privileged"
    if any(set(c.get("capabilities", {}).get("add", [])) - BASELINE_CAPS for c in ctxs):
        return "privileged"
    pod_ctx = pod.get("securityContext", {})
    restricted = (
        pod_ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault"
        and all(c.get("allowPrivilegeEscalation") is False for c in ctxs)
        and all(c.get("capabilities", {}).get("drop") == ["ALL"] for c in ctxs)
        and all(set(c.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"} for c in ctxs)
        and (pod_ctx.get("runAsNonRoot") is True or all(c.get("runAsNonRoot") for c in ctxs))
        and all(
            set(v) & {"emptyDir", "configMap", "secret", "projected", "persistentVolumeClaim"}
            for v in pod.get("volumes", [])
        )
    )
    return "restricted" if restricted else "baseline"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_container_drops_all_capabilities_and_cannot_escalate(preset: str) -> None:
    for role, pod in pods(render(cr(preset)).objects).items():
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, role
        for c in pod["containers"]:
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["privileged"] is False, role
            assert ctx["readOnlyRootFilesystem"] is True, role
            assert ctx["capabilities"]["drop"] == ["ALL"], role
            want = ["IPC_LOCK"] if preset in EFA_ACCELERATORS and role != "router" else None
            assert ctx["capabilities"].get("add") == want, (preset, role)


@pytest.mark.parametrize(
    ("preset", "engines"),
    [("cpu", "restricted"), ("none", "baseline")] + [(p, "privileged") for p in EFA_ACCELERATORS],
)
def test_pod_security_level_of_each_role(preset: str, engines: str) -> None:
    levels = {role: pss_level(pod) for role, pod in pods(render(cr(preset)).objects).items()}
    assert levels == {"prefill": engines, "decode": engines, "router": "restricted"}


def test_read_only_root_gets_scratch_for_every_path_vllm_writes() -> None:
    for role in ("prefill", "decode"):
        pod = pods(render(cr("cpu")).objects)[role]
        (c,) = pod["containers"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert {"/tmp", "/var/tmp", security.SCRATCH_DIR} <= set(mounts)
        assert {"name": "scratch", "emptyDir": {}} in pod["volumes"]
        assert {"name": "HOME", "value": security.SCRATCH_DIR} in c["env"]
        assert pod["securityContext"]["runAsUser"] == 1001 and pod["securityContext"]["runAsNonRoot"]


def test_user_env_of_the_same_name_wins_over_scratch_home() -> None:
    obj = cr("cpu")
    obj["spec"]["prefill"] = {"env": [{"name": "HOME", "value": "/data"}]}
    (c,) = pods(render(obj).objects)["prefill"]["containers"]
    assert [e for e in c["env"] if e["name"] == "HOME"] == [{"name": "HOME", "value": "/data"}]


def test_secrets_are_referenced_never_inlined() -> None:
    obj = cr(
        "p5en",
        modelToken={"name": "hf-token"},
        router={"apiKeySecret": {"name": "router-key", "key": "api-key"}},
    )
    objs = render(obj).objects
    ps = pods(objs)
    for role in ("prefill", "decode"):
        env = ps[role]["containers"][0]["env"]
        assert {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
        } in env
        assert not any(e["name"] == "HF_TOKEN" and "value" in e for e in env)
    (router,) = ps["router"]["containers"]
    ref = {"secretKeyRef": {"name": "router-key", "key": "api-key"}}
    assert router["env"] == [{"name": security.ROUTER_API_KEY_ENV, "valueFrom": ref}]
    (cm,) = by_kind(objs, "ConfigMap")
    assert yaml.safe_load(cm["data"]["router.yaml"])["auth"] == {"api_key_env": security.ROUTER_API_KEY_ENV}
    assert security.referenced_secrets(parse_spec(obj["spec"])) == [
        ("hf-token", "token", "spec.modelToken (HF_TOKEN)"),
        ("router-key", "api-key", "spec.router.apiKeySecret"),
    ]


def test_without_an_api_key_secret_the_router_config_has_no_auth() -> None:
    (cm,) = by_kind(render(cr("cpu")).objects, "ConfigMap")
    assert "auth" not in yaml.safe_load(cm["data"]["router.yaml"])


def test_secret_references_are_validated() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"model": "m", "modelToken": {"key": "t"}, "router": {"apiKeySecret": {"name": ""}}})
    text = str(err.value)
    assert "spec.modelToken.name: required" in text
    assert "spec.router.apiKeySecret.name: must not be empty" in text
    assert "spec.router.apiKeySecret.key: required" in text


@pytest.mark.parametrize("preset", PRESETS)
def test_network_policies_isolate_engines_and_expose_only_the_router(preset: str) -> None:
    objs = render(cr(preset)).objects
    engines, router = by_kind(objs, "NetworkPolicy")
    name = f"s-{preset}"
    assert engines["metadata"]["name"] == f"{name}-engines" and router["metadata"]["name"] == f"{name}-router"
    same_cr = {
        "matchLabels": {"kvferry.io/name": name},
        "matchExpressions": [{"key": "kvferry.io/role", "operator": "In", "values": ["prefill", "decode"]}],
    }
    assert engines["spec"]["podSelector"] == same_cr and engines["spec"]["policyTypes"] == ["Ingress"]
    peers, via_router, metrics = engines["spec"]["ingress"]
    assert peers == {"from": [{"podSelector": same_cr}], "ports": [{"protocol": "TCP"}]}
    router_pods = {"matchLabels": {"kvferry.io/name": name, "kvferry.io/role": "router"}}
    http = [{"protocol": "TCP", "port": "http"}]
    # the router also follows the engines' KV-cache events (prefix-aware routing, on by default)
    events = [{"protocol": "TCP", "port": "kv-events"}, {"protocol": "TCP", "port": "kv-replay"}]
    assert via_router == {"from": [{"podSelector": router_pods}], "ports": http + events}
    assert metrics == {"from": [security.operator_peer("kvferry-system")], "ports": http}
    assert router["spec"] == {
        "podSelector": router_pods,
        "policyTypes": ["Ingress"],
        "ingress": [{"ports": http}],
    }


def test_network_policy_clients_readers_and_opt_out() -> None:
    clients = [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]
    readers = [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]
    objs = render(cr("cpu", networkPolicy={"clients": clients, "metricsReaders": readers})).objects
    engines, router = by_kind(objs, "NetworkPolicy")
    assert router["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": "http"}], "from": clients}]
    assert engines["spec"]["ingress"][2]["from"] == readers
    assert by_kind(render(cr("cpu", networkPolicy={"enabled": False})).objects, "NetworkPolicy") == []


def test_no_rendered_object_carries_a_secret_value_field() -> None:
    """Secrets reach pods only as secretKeyRef; nothing rendered holds `stringData`/`data` of a Secret."""
    objs = render(
        cr("cpu", modelToken={"name": "hf"}, router={"apiKeySecret": {"name": "k", "key": "v"}})
    ).objects
    assert not by_kind(objs, "Secret")
    text = json.dumps(objs)
    assert text.count("secretKeyRef") == 3  # prefill, decode, router


def test_missing_secret_sets_degraded_and_survives_a_status_refresh() -> None:
    kw = dict(
        cr_name="x", namespace="ns", generation=1, revision="r", desired={"prefill": 1, "decode": 1},
        router_replicas=1, now="t",
    )  # fmt: skip
    message = "secret hf (key token, spec.modelToken (HF_TOKEN)) not found in namespace ns"
    first = status.summarize(
        status.Observed(faults={status.Reason.SECRET_MISSING: message}), previous={}, **kw
    )
    degraded = status.condition(first, status.ConditionType.DEGRADED)
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "SecretMissing", message)
    # A status refresh from watched objects does not check Secrets: it keeps the finding.
    refreshed = status.summarize(status.Observed(), previous=first, **kw)
    assert status.condition(refreshed, status.ConditionType.DEGRADED)["reason"] == "SecretMissing"
    # The next reconcile finds the Secret: the condition clears.
    fixed = status.summarize(status.Observed(faults={}), previous=refreshed, **kw)
    assert status.condition(fixed, status.ConditionType.DEGRADED)["status"] == "False"


def test_default_metrics_readers_are_operator_pods_in_the_operator_namespace_only() -> None:
    """Anyone may label their own pods as the operator's; only the namespace pins who reads /metrics."""
    objs = render(cr("cpu"), operator_namespace="ops").objects
    engines = next(o for o in by_kind(objs, "NetworkPolicy") if o["metadata"]["name"].endswith("-engines"))
    peers = [p for rule in engines["spec"]["ingress"] for p in rule["from"] if "namespaceSelector" in p]
    assert peers == [security.operator_peer("ops")]
    assert peers[0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}


def test_a_load_balancer_router_needs_an_api_key() -> None:
    with pytest.raises(SpecError, match="router.apiKeySecret"):
        parse_spec({"model": "m", "router": {"serviceType": "LoadBalancer"}})
    key = {"name": "k", "key": "v"}
    parse_spec({"model": "m", "router": {"serviceType": "LoadBalancer", "apiKeySecret": key}})
