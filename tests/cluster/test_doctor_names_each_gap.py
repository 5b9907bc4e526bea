"""`kvferry doctor` on the local control plane: a healthy p5en setup passes, then each test plants one gap
(a missing CRD, operator, node, taint toleration, device, device plugin, scheduler, DRA slice, image pull)
and the doctor names it with its fix and exits 1. Everything the doctor should see lives on private kwok
nodes (a pool label the CR selects) and in the test's namespace (`--addons-namespace`), so other tests'
nodes and add-ons do not count.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kvferry.local.controlplane import ControlPlane, nodes
from kvferry.tools.doctor import cli

from tests.cluster.operator_fixtures import ROOT, WAIT_S
from tests.cluster.test_dra_device_claims_on_kwok_nodes import ALIGNED, DEVICE_CLASSES, slices
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

POOL = "kvferry.io/test-pool"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
NEURON_TAINT = {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}


class Setup:
    def __init__(self, plane: ControlPlane, namespace: str, tmp_path: Any) -> None:
        self.plane, self.ns, self.tmp = plane, namespace, tmp_path
        self.nodes: list[str] = []

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return str(self.plane.kubectl(*args, input=input, check=check).stdout)

    def apply(self, *objs: dict[str, Any]) -> None:
        self.kubectl(
            "-n",
            self.ns,
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}),
        )

    def node(
        self, shape: nodes.NodeShape, *, drop: tuple[str, ...] = (), taint: dict[str, str] | None = None
    ) -> str:
        body = nodes.manifest(shape, 300 + len(self.nodes))
        name = f"doc-{self.ns}-{len(self.nodes)}"[:63]
        body["metadata"]["name"] = name
        body["metadata"]["labels"].update({"kubernetes.io/hostname": name, POOL: self.ns})
        if taint:
            body["spec"]["taints"].append(taint)
        for key in drop:
            body["status"]["capacity"].pop(key)
            body["status"]["allocatable"].pop(key)
        self.kubectl("apply", "-f", "-", input=json.dumps(body))
        patch = json.dumps({"status": body["status"]})
        self.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p", patch)
        self.nodes.append(name)
        return name

    def daemonset(self, name: str, image: str, tolerations: list[dict[str, str]]) -> None:
        labels = {"app": name}
        self.apply(
            {
                "apiVersion": "apps/v1",
                "kind": "DaemonSet",
                "metadata": {"name": name},
                "spec": {
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "nodeSelector": {POOL: "none"},  # its pods are not the point: its tolerations are
                            "tolerations": tolerations,
                            "containers": [{"name": "plugin", "image": image}],
                        },
                    },
                },
            }
        )

    def deployment(self, name: str, labels: dict[str, str] | None = None) -> None:
        """A Deployment whose pod kwok runs on the pool's first node (so it becomes ready)."""
        sel = {"app": name}
        self.apply(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": name, "labels": labels or {}},
                "spec": {
                    "selector": {"matchLabels": sel},
                    "template": {
                        "metadata": {"labels": sel},
                        "spec": {
                            "nodeSelector": {POOL: self.ns},
                            "tolerations": [{"operator": "Exists"}],
                            "containers": [{"name": "c", "image": f"example.invalid/{name}:1"}],
                        },
                    },
                },
            }
        )

    def wait_ready(self, *deployments: str) -> None:
        def ready() -> bool:
            out = json.loads(self.kubectl("-n", self.ns, "get", "deployments", "-o", "json"))["items"]
            have = {d["metadata"]["name"] for d in out if (d.get("status") or {}).get("readyReplicas")}
            return set(deployments) <= have

        wait_until(ready, f"deployments {deployments} ready", WAIT_S)

    def healthy_p5en(self, *, node: bool = True) -> None:
        """A node (unless the test made its own), the operator and both device plugins, tolerating."""
        if node:
            self.node(nodes.P5EN)
        self.plane.wait_nodes_ready(self.nodes)
        self.deployment(
            "kvferry", {"app.kubernetes.io/name": "kvferry", "app.kubernetes.io/component": "operator"}
        )
        self.daemonset(
            "nvidia-device-plugin-daemonset", "nvcr.io/nvidia/k8s-device-plugin:v0.19.0", [GPU_TAINT]
        )
        self.daemonset(
            "aws-efa-k8s-device-plugin",
            "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin:v0.5.8",
            [GPU_TAINT],
        )
        self.wait_ready("kvferry")

    def doctor(self, cr: make_inference, *, by_name: bool = False) -> tuple[int, list[str]]:
        """Run `kvferry doctor` on the CR as a file, or (by_name) created in the cluster and named."""
        obj = cr.obj()
        obj["metadata"]["namespace"] = self.ns
        for role in ("prefill", "decode"):  # the CR's pods may land only on this test's nodes
            part = obj["spec"].setdefault(role, {})
            part.setdefault("nodeSelector", {})[POOL] = self.ns
            part.setdefault("tolerations", []).append({"key": POOL, "operator": "Exists"})
        path = self.tmp / "cr.yaml"
        path.write_text(yaml.safe_dump(obj))
        ref = [str(path)]
        if by_name:
            self.kubectl("-n", self.ns, "apply", "-f", str(path))
            ref = [obj["metadata"]["name"], "-n", self.ns]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli.main([*ref, "--kubeconfig", str(self.plane.kubeconfig), "--addons-namespace", self.ns])
        return rc, out.getvalue().splitlines()


@pytest.fixture
def setup(control_plane: ControlPlane, namespace: str, kvferry_crd: str, tmp_path: Any) -> Iterator[Setup]:
    s = Setup(control_plane, namespace, tmp_path)
    try:
        yield s
    finally:
        s.kubectl("-n", namespace, "delete", "deployments,daemonsets", "--all", "--wait=false", check=False)
        s.kubectl(
            "-n",
            namespace,
            "delete",
            "pods",
            "--all",
            "--grace-period=0",
            "--force",
            "--wait=false",
            check=False,
        )
        for name in s.nodes:
            s.kubectl("delete", "resourceslices", f"--field-selector=spec.nodeName={name}", check=False)
        if s.nodes:
            s.kubectl("delete", "node", *s.nodes, "--wait=false", check=False)


def p5en(**prefill: Any) -> make_inference:
    return make_inference("doc", accelerator="p5en").prefill(tensorParallelSize=2, **prefill)


def gaps(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("GAP")]


def the_gap(rc: int, lines: list[str], *words: str) -> str:
    assert rc == 1, lines
    found = [g for g in gaps(lines) if all(w in g for w in words)]
    assert found, f"no GAP line with {words}:\n" + "\n".join(lines)
    return found[0]


def test_a_healthy_p5en_cluster_passes_every_check(setup: Setup) -> None:
    setup.healthy_p5en()
    rc, lines = setup.doctor(p5en())
    assert rc == 0 and not gaps(lines), "\n".join(lines)
    assert any(line.startswith("OK   nodes/prefill/vpc.amazonaws.com/efa") for line in lines), lines
    rc, by_name = setup.doctor(p5en(), by_name=True)  # the CR as the cluster stores it
    assert rc == 0 and by_name == lines, "\n".join(by_name)


def test_missing_crd(setup: Setup, kvferry_crd: str) -> None:
    setup.healthy_p5en()
    setup.kubectl("delete", "crd", kvferry_crd)
    try:
        gap = the_gap(*setup.doctor(p5en()), "crd", kvferry_crd, "helm install")
        assert "not installed" in gap
    finally:  # the session's other tests rely on it
        setup.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            str(ROOT / "crds/disaggregatedinferences.yaml"),
        )
        setup.kubectl("wait", "--for=condition=Established", f"crd/{kvferry_crd}", "--timeout=60s")


def test_missing_operator(setup: Setup) -> None:
    setup.healthy_p5en()
    setup.kubectl("-n", setup.ns, "delete", "deployment", "kvferry")
    the_gap(*setup.doctor(p5en()), "operator", "no kvferry operator Deployment", "helm install")


def test_no_node_of_the_instance_type(setup: Setup) -> None:
    setup.healthy_p5en()
    rc, lines = setup.doctor(p5en(nodeSelector={"node.kubernetes.io/instance-type": "p5.48xlarge"}))
    the_gap(rc, lines, "nodes/prefill", "no node labelled", "p5.48xlarge", "node group")


def test_untolerated_taint(setup: Setup) -> None:
    setup.node(nodes.P5EN, taint={"key": "team", "value": "a", "effect": "NoSchedule"})
    setup.healthy_p5en(node=False)
    the_gap(*setup.doctor(p5en()), "nodes/prefill", "team=a:NoSchedule", "spec.prefill.tolerations")


def test_nodes_without_efa_name_the_efa_device_plugin(setup: Setup) -> None:
    setup.node(nodes.P5EN, drop=(nodes.EFA,))
    setup.plane.wait_nodes_ready(setup.nodes)
    setup.deployment(
        "kvferry", {"app.kubernetes.io/name": "kvferry", "app.kubernetes.io/component": "operator"}
    )
    setup.daemonset("nvidia-device-plugin-daemonset", "nvcr.io/nvidia/k8s-device-plugin:v0.19.0", [GPU_TAINT])
    gap = the_gap(*setup.doctor(p5en()), "nodes/prefill/vpc.amazonaws.com/efa", "no node allocates 4")
    assert "eks/aws-efa-k8s-device-plugin" in gap
    the_gap(*setup.doctor(p5en()), "plugin/vpc.amazonaws.com/efa", "no EFA device plugin DaemonSet")


def test_nodes_with_efa_only_through_dra_name_efa_attach_dra(setup: Setup) -> None:
    node = setup.node(nodes.P5EN, drop=(nodes.EFA,))
    setup.healthy_p5en(node=False)
    setup.apply(*slices(node, ALIGNED))  # cluster-scoped: namespace ignored
    the_gap(*setup.doctor(p5en()), "nodes/prefill/vpc.amazonaws.com/efa", "efaAttach: dra")


def test_efa_device_plugin_and_dra_driver_on_one_node(setup: Setup) -> None:
    setup.healthy_p5en()  # the node allocates vpc.amazonaws.com/efa: the device plugin runs there
    setup.apply(*slices(setup.nodes[0], ALIGNED))  # ...and dra.net publishes its EFA devices too
    the_gap(*setup.doctor(p5en()), "efa-managers/prefill", setup.nodes[0], "must not run on the same node")


def test_device_plugin_that_does_not_tolerate_the_gpu_taint(setup: Setup) -> None:
    setup.healthy_p5en()
    setup.daemonset("aws-efa-k8s-device-plugin", "eks/aws-efa-k8s-device-plugin:v0.5.8", [])  # chart default
    gap = the_gap(
        *setup.doctor(p5en()),
        "plugin/vpc.amazonaws.com/efa",
        "does not tolerate",
        "nvidia.com/gpu=true:NoSchedule",
    )
    assert "{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}" in gap


def test_dra_role_without_resource_slices(setup: Setup) -> None:
    setup.healthy_p5en()
    setup.kubectl("delete", "deviceclass", *(c["metadata"]["name"] for c in DEVICE_CLASSES), check=False)
    the_gap(
        *setup.doctor(p5en(efaAttach="dra")), "deviceclasses/prefill", "efa.networking.k8s.aws", "aws-dranet"
    )
    for cls in DEVICE_CLASSES:
        setup.kubectl("apply", "-f", "-", input=json.dumps(cls))
    rc, lines = setup.doctor(p5en(efaAttach="dra"))
    the_gap(rc, lines, "nodes/prefill/dra", "no ResourceSlices", "aws-dranet")
    setup.apply(*slices(setup.nodes[0], ALIGNED))
    rc, lines = setup.doctor(p5en(efaAttach="dra"))
    assert any(line.startswith("OK   nodes/prefill/dra") for line in lines), lines


def _trn2(setup: Setup, *, scheduler: bool, efa_toleration: bool) -> tuple[int, list[str]]:
    setup.node(nodes.TRN2)
    setup.plane.wait_nodes_ready(setup.nodes)
    setup.deployment(
        "kvferry", {"app.kubernetes.io/name": "kvferry", "app.kubernetes.io/component": "operator"}
    )
    setup.daemonset("neuron-device-plugin", "public.ecr.aws/neuron/neuron-device-plugin:2.26", [NEURON_TAINT])
    setup.daemonset(
        "aws-efa-k8s-device-plugin",
        "eks/aws-efa-k8s-device-plugin:v0.5.8",
        [NEURON_TAINT] if efa_toleration else [],
    )
    ready = ["kvferry"]
    if scheduler:
        setup.deployment("my-scheduler")
        setup.deployment("k8s-neuron-scheduler")
        ready += ["my-scheduler", "k8s-neuron-scheduler"]
    setup.wait_ready(*ready)
    return setup.doctor(trn2_cr())


def trn2_cr() -> make_inference:
    """TP 4 prefill, TP 8 decode: Neuron's documented pull setup (docs/trainium.md)."""
    cr = make_inference("doc", accelerator="trn2").kv(connector="vllm", mode="pull")
    return cr.prefill(tensorParallelSize=4).decode(tensorParallelSize=8)


def test_trn2_with_neuron_plugin_scheduler_and_efa_toleration_passes(setup: Setup) -> None:
    rc, lines = _trn2(setup, scheduler=True, efa_toleration=True)
    assert rc == 0 and not gaps(lines), "\n".join(lines)
    assert any(line.startswith("OK   scheduler-extension/") for line in lines), lines


def test_trn2_without_the_neuron_scheduler_and_extension(setup: Setup) -> None:
    rc, lines = _trn2(setup, scheduler=False, efa_toleration=True)
    the_gap(rc, lines, "scheduler/prefill", "my-scheduler", "scheduler.enabled=true")
    the_gap(rc, lines, "scheduler-extension/prefill", "Neuron scheduler extension")


def test_trn2_efa_plugin_without_the_neuron_toleration(setup: Setup) -> None:
    rc, lines = _trn2(setup, scheduler=True, efa_toleration=False)
    the_gap(rc, lines, "plugin/vpc.amazonaws.com/efa", "aws.amazon.com/neuron=true:NoSchedule")


def test_trn2_without_the_neuron_device_plugin(setup: Setup) -> None:
    rc, lines = _trn2(setup, scheduler=True, efa_toleration=True)
    assert rc == 0, lines
    setup.kubectl("-n", setup.ns, "delete", "daemonset", "neuron-device-plugin")
    rc, lines = setup.doctor(trn2_cr())
    the_gap(
        rc, lines, "plugin/aws.amazon.com/neuron", "no Neuron device plugin DaemonSet", "neuron-helm-chart"
    )


def test_gang_kueue_and_multi_node_roles_need_their_crds(setup: Setup) -> None:
    setup.healthy_p5en()
    crds = set(setup.kubectl("get", "crd", "-o", "name").split())
    cr = p5en().decode(tensorParallelSize=16).set(placement={"gang": "kueue", "queueName": "q"})
    rc, lines = setup.doctor(cr)
    for check, crd in (
        ("lws", "leaderworkersets.leaderworkerset.x-k8s.io"),
        ("kueue", "workloads.kueue.x-k8s.io"),
    ):
        line = next(x for x in lines if x.split()[1].rstrip(":") == check)
        present = f"customresourcedefinition.apiextensions.k8s.io/{crd}" in crds
        assert line.startswith("OK" if present else "GAP"), (line, present)
        if not present:
            assert crd in line and "install" in line


def test_image_pull_failures_seen_on_the_crs_pods(setup: Setup) -> None:
    setup.healthy_p5en()
    image = "ghcr.io/kvferry/vllm:0.32.0-kvferry0.1.0"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "doc-prefill-0", "labels": {"kvferry.io/name": "doc"}},
        "spec": {"nodeSelector": {POOL: "nowhere"}, "containers": [{"name": "vllm", "image": image}]},
    }
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "doc-prefill-0.pull"},
        "involvedObject": {"kind": "Pod", "name": "doc-prefill-0", "namespace": setup.ns},
        "reason": "Failed",
        "type": "Warning",
        "message": f'Failed to pull image "{image}": not found',
    }
    setup.apply(pod, event)
    gap = the_gap(*setup.doctor(p5en()), "images", image, "not found")
    assert "imagePullSecrets" in gap


def test_an_invalid_cr_exits_2_with_the_api_servers_message(
    setup: Setup, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _ = setup.doctor(make_inference("doc", accelerator="trn2").decode(efaAttach="dra"))
    assert rc == 2
    assert "efaAttach dra is rendered for the GPU presets" in capsys.readouterr().err
