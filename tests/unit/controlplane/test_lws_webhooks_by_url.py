"""The LWS controller on a local plane: its release's webhook registrations pointed at 127.0.0.1 by URL,
trusting the plane's CA, with pod webhooks narrowed to LWS's pods (as its kustomize patch does)."""

from __future__ import annotations

import base64
from pathlib import Path

from kvferry.local.controlplane import build, lws

MANIFESTS = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: mutating-webhook-configuration}
webhooks:
- name: mleaderworkerset.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate-lws}}
  rules: [{apiGroups: [leaderworkerset.x-k8s.io], resources: [leaderworkersets], operations: [CREATE]}]
- name: mpod.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}}
  rules: [{apiGroups: [""], resources: [pods], operations: [CREATE]}]
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: validating-webhook-configuration}
webhooks:
- name: vpod.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /validate--v1-pod}}
  rules: [{apiGroups: [""], resources: [pods], operations: [CREATE, UPDATE]}]
"""


def test_registrations_call_loopback_by_url_and_only_for_lws_pods() -> None:
    regs = lws.webhook_registrations(MANIFESTS, 9443, b"CA PEM")
    assert [r["metadata"]["name"] for r in regs] == [
        "kvferry-local-lws-mutating-webhook-configuration",
        "kvferry-local-lws-validating-webhook-configuration",
    ]
    hooks = [h for r in regs for h in r["webhooks"]]
    assert [h["clientConfig"]["url"] for h in hooks] == [
        "https://127.0.0.1:9443/mutate-lws",
        "https://127.0.0.1:9443/mutate--v1-pod",
        "https://127.0.0.1:9443/validate--v1-pod",
    ]
    assert all(base64.b64decode(h["clientConfig"]["caBundle"]) == b"CA PEM" for h in hooks)
    assert "objectSelector" not in hooks[0]  # the LWS object webhook: every LWS
    assert hooks[1]["objectSelector"] == hooks[2]["objectSelector"] == lws.POD_SELECTOR  # never other pods


def test_the_controller_runs_without_its_own_certs_or_leader_election(tmp_path: Path) -> None:
    cfg = lws.config(9443, 8081, tmp_path)
    assert cfg["internalCertManagement"] == {"enable": False}
    assert cfg["leaderElection"] == {"leaderElect": False}
    assert cfg["webhook"] == {"host": "127.0.0.1", "port": 9443, "certDir": str(tmp_path)}
    assert cfg["health"]["healthProbeBindAddress"] == "127.0.0.1:8081"


def test_lws_is_a_pinned_component_with_its_manifests() -> None:
    (comp,) = [c for c in build.COMPONENTS if c.name == "lws"]
    assert comp.binaries == ("lws-controller",) and comp.name in build.BUILDERS
    assert set(build.LWS_MANIFESTS) == {"crd.yaml", "webhooks.yaml"}
