"""Secrets with the operator as a real process: a missing Secret gives a condition and an event naming it;
a Secret's value appears in no object of the namespace and in no line of the operator's log."""

from __future__ import annotations

import base64
import json
import secrets

import pytest
from kubernetes import client
from kvferry.operator.spec import names

from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

pytestmark = pytest.mark.cluster

# Every namespaced kind the operator writes or that could echo a value (events, CR status), not Secrets.
SCANNED = (
    "disaggregatedinferences,configmaps,services,statefulsets,deployments,poddisruptionbudgets,"
    "serviceaccounts,roles,rolebindings,networkpolicies,pods,events,controllerrevisions,endpointslices"
)


def make_secret(api, namespace: str, name: str, key: str, value: str) -> None:
    body = {"metadata": {"name": name}, "stringData": {key: value}}
    client.CoreV1Api(api).create_namespaced_secret(namespace, body)


def test_missing_secret_is_named_and_no_value_leaks(cluster, start_operator, admin_api) -> None:
    token, api_key = f"hf_{secrets.token_hex(16)}", f"key_{secrets.token_hex(16)}"
    make_secret(admin_api, cluster.ns, "hf-token", "token", token)
    op = start_operator("--metrics-interval", "1", env={"KVFERRY_RESYNC_INTERVAL": "2"})
    cr = make_inference(
        "sec",
        modelToken={"name": "hf-token"},
        router={"apiKeySecret": {"name": "router-key", "key": "api-key"}},
    ).obj()
    cluster.apply(cr)

    # The router's Secret is missing: Degraded names it, an event says the same.
    want = f"secret router-key (key api-key, spec.router.apiKeySecret) not found in namespace {cluster.ns}"
    degraded = wait_until(
        lambda: (c := cluster.condition("sec", "Degraded")).get("reason") == "SecretMissing" and c,
        "Degraded/SecretMissing",
    )
    assert degraded["status"] == "True" and degraded["message"] == want, degraded
    assert "hf-token" not in degraded["message"]  # that one exists
    # kopf posts the reconcile's events after the handler returns, so after the status it wrote.
    wait_until(
        lambda: any(want in e["message"] for e in cluster.events("SecretMissing")), "SecretMissing event"
    )

    # Pods read the values through secretKeyRef; the operator wrote every object regardless.
    sts = cluster.get("statefulset", names.role_name("sec", "prefill"))
    env = sts["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in env

    # Creating the Secret clears the condition at the next reconcile (resync: Secrets are not watched).
    make_secret(admin_api, cluster.ns, "router-key", "api-key", api_key)
    wait_until(
        lambda: cluster.condition("sec", "Degraded").get("reason") != "SecretMissing", "condition cleared"
    )

    # No value, plain or base64, in any object of the namespace or in the operator's log.
    dump = cluster.kubectl("get", SCANNED, "-o", "json").stdout
    assert json.loads(dump)["items"], "scan read nothing"
    log = op.text()
    assert "reconcile" in log.lower() or "handler" in log.lower(), "operator log looks empty"
    for value in (token, api_key):
        for form in (value, base64.b64encode(value.encode()).decode()):
            assert form not in dump, "a Secret value is in an object of the namespace"
            assert form not in log, "a Secret value is in the operator's log"
