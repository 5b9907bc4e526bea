"""Kueue on a local plane: built only on demand (never by `kvferry cluster build` or setup), run
with the plain-pod integration only, its pod webhooks by URL skipping kube-system."""

from __future__ import annotations

from pathlib import Path

from kvferry.local.controlplane import build, kueue

MANIFESTS = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: mutating-webhook-configuration}
webhooks:
- name: mclusterqueue.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate-cq}}
  rules: [{apiGroups: [kueue.x-k8s.io], resources: [clusterqueues], operations: [CREATE]}]
- name: mpod.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}}
  rules: [{apiGroups: [""], resources: [pods], operations: [CREATE]}]
"""


def test_kueue_is_built_only_on_demand() -> None:
    assert "kueue" not in {c.name for c in build.COMPONENTS}  # setup never builds it (tests do)
    (comp,) = build.ON_DEMAND
    assert comp.name == "kueue" and comp.name in build.BUILDERS
    assert "webhooks.yaml" in build.KUEUE_MANIFESTS
    assert {f"crd-{k}.yaml" for k in ("workloads", "clusterqueues", "localqueues")} <= set(
        build.KUEUE_MANIFESTS
    )


def test_only_plain_pods_are_managed_and_pod_webhooks_skip_system_namespaces(tmp_path: Path) -> None:
    cfg = kueue.config(9443, 8081, tmp_path)
    assert cfg["integrations"] == {"frameworks": ["pod"]}  # the statefulset integration would split P and D
    assert cfg["internalCertManagement"] == {"enable": False}
    regs = kueue.webhooks.by_url(MANIFESTS, kueue.WEBHOOK_PREFIX, 9443, b"CA", kueue.PODS)
    cq, pod = regs[0]["webhooks"]
    assert cq["clientConfig"]["url"] == "https://127.0.0.1:9443/mutate-cq" and "namespaceSelector" not in cq
    assert pod["namespaceSelector"] == cfg["managedJobsNamespaceSelector"]


def test_the_controller_runs_in_a_mount_namespace_with_its_metrics_cert(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(kueue, "METRICS_CERTS", tmp_path / "etc-kueue-metrics-certs")
    argv = kueue.in_mount_namespace(["/bin/kueue-controller", "--config=c"], tmp_path / "certs")
    assert argv[:4] == ["unshare", "--mount", "--propagation", "private"]
    assert f"mount --bind {tmp_path / 'certs'} {tmp_path / 'etc-kueue-metrics-certs'}" in argv[6]
    assert argv[-2:] == ["/bin/kueue-controller", "--config=c"]
