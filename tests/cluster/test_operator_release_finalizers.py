"""With the operator gone, a deleted CR hangs on kopf's finalizer; `kvferry release-finalizers` frees it
(and refuses while an operator Deployment is ready)."""

from __future__ import annotations

import shutil
import subprocess
import time

from kubernetes import client
from kvferry.operator.runtime.finalizers import FINALIZERS, OPERATOR_SELECTOR
from kvferry.operator.spec import GROUP, PLURAL, VERSION

from tests.cluster.operator_fixtures import exists
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until


def _release(kubeconfig, ns: str) -> subprocess.CompletedProcess:
    exe = shutil.which("kvferry")
    assert exe, "kvferry console script not on PATH (source scripts/env.sh)"
    argv = [exe, "release-finalizers", "-n", ns, "--kubeconfig", str(kubeconfig)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def _fake_operator_deployment(ns: str) -> client.V1Deployment:
    labels = dict(part.split("=") for part in OPERATOR_SELECTOR.split(","))
    pod = client.V1PodSpec(containers=[client.V1Container(name="operator", image="kvferry:test")])
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name="kvferry", labels=labels),
        spec=client.V1DeploymentSpec(
            replicas=1,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(metadata=client.V1ObjectMeta(labels=labels), spec=pod),
        ),
    )


def test_release_finalizers_frees_a_cr_deleted_after_the_operator_stopped(
    cluster, start_operator, kubeconfig
) -> None:
    ns = cluster.ns
    op = start_operator("--metrics-interval", "1", "--metrics-url", "http://127.0.0.1:9/{pod}")
    cluster.apply(make_inference("rf", accelerator="none", image="vllm:1").obj())
    wait_until(
        lambda: set(cluster.cr("rf")["metadata"].get("finalizers") or []) & set(FINALIZERS), "finalizer"
    )
    assert op.stop() == 0

    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "rf")
    wait_until(lambda: cluster.cr("rf")["metadata"].get("deletionTimestamp"), "deletionTimestamp")
    time.sleep(3)
    assert cluster.cr("rf")["metadata"]["finalizers"], "CR went without the operator"  # it hangs

    # A ready operator Deployment (kwok runs its pod) makes the command refuse.
    cluster.apps.create_namespaced_deployment(ns, _fake_operator_deployment(ns))
    wait_until(
        lambda: (
            (cluster.apps.read_namespaced_deployment(name="kvferry", namespace=ns).status.ready_replicas or 0)
            > 0
        ),
        "fake operator Deployment ready",
    )
    res = _release(kubeconfig, ns)
    assert res.returncode == 2 and "operator is running" in res.stderr, (res.stdout, res.stderr)
    assert exists(cluster.custom.get_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, "rf")
    cluster.apps.delete_namespaced_deployment("kvferry", ns)
    wait_until(lambda: not exists(cluster.apps.read_namespaced_deployment, "kvferry", ns), "Deployment gone")

    res = _release(kubeconfig, ns)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert f"released {ns}/rf" in res.stdout
    wait_until(
        lambda: not exists(cluster.custom.get_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, "rf"),
        "CR gone",
    )

    # Nothing holds the namespace any more: it goes (pods forced, as the cluster fixture does).
    cluster.core.delete_namespace(ns)
    cluster.kubectl("delete", "pods", "--all", "--grace-period=0", "--force", "--wait=false", check=False)
    wait_until(lambda: not exists(cluster.core.read_namespace, ns), "namespace gone")
