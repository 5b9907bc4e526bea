"""kvferry doctor's pure half: what a CR needs (read from its render) and the checks over a snapshot.
The cluster tier (tests/cluster/test_doctor_names_each_gap.py) plants each gap on the real API server."""

from __future__ import annotations

from typing import Any

from kvferry.tools.doctor import checks
from kvferry.tools.doctor.needs import EFA, GPU, NEURON, needs_of

from tests.unit.operator.cases import make_inference


def _node(
    name: str, labels: dict[str, str], allocatable: dict[str, str], taints: list[dict[str, str]]
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints},
        "status": {"allocatable": allocatable},
    }


P5EN_LABELS = {"node.kubernetes.io/instance-type": "p5en.48xlarge"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}


def test_needs_come_from_the_render_of_each_preset() -> None:
    p5en = needs_of(make_inference("a", accelerator="p5en").prefill(tensorParallelSize=2).obj())
    prefill = next(r for r in p5en.roles if r.role == "prefill")
    assert prefill.devices == {GPU: 2, EFA: 4}
    assert prefill.node_selector == P5EN_LABELS and not prefill.dra_claim
    dra = needs_of(make_inference("a", accelerator="p5en").prefill(efaAttach="dra").obj())
    assert next(r for r in dra.roles if r.role == "prefill").dra_claim
    assert next(r for r in dra.roles if r.role == "prefill").devices == {}  # the claim holds them
    trn2 = needs_of(
        make_inference("a", accelerator="trn2")
        .kv(connector="vllm", mode="pull")
        .prefill(tensorParallelSize=4)
        .decode(tensorParallelSize=8)
        .obj()
    )
    assert all(r.scheduler_name == "my-scheduler" and NEURON in r.devices for r in trn2.roles)
    multi = needs_of(make_inference("a", accelerator="p5en").decode(tensorParallelSize=16).obj())
    assert multi.lws and not multi.kueue


def test_tolerations_match_as_kubernetes_matches_them() -> None:
    assert checks.tolerates([{"key": "nvidia.com/gpu", "operator": "Exists"}], GPU_TAINT)
    assert checks.tolerates([{"operator": "Exists"}], GPU_TAINT)  # empty key + Exists: everything
    assert checks.tolerates([{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}], GPU_TAINT)
    assert not checks.tolerates([{"key": "nvidia.com/gpu", "value": "false"}], GPU_TAINT)
    assert not checks.tolerates(
        [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}], GPU_TAINT
    )
    assert not checks.tolerates([], GPU_TAINT)


def test_a_node_short_of_efa_names_the_efa_device_plugin_and_counts() -> None:
    needs = needs_of(make_inference("a", accelerator="p5en").prefill(tensorParallelSize=8).obj())
    role = next(r for r in needs.roles if r.role == "prefill")
    snap = checks.Snapshot(nodes=[_node("n1", P5EN_LABELS, {GPU: "8", EFA: "15"}, [GPU_TAINT])])
    (gpu, efa) = checks.check_nodes(role, snap)
    assert gpu.ok and not efa.ok
    assert "no node allocates 16 vpc.amazonaws.com/efa (n1: 15)" in efa.detail
    assert "aws-efa-k8s-device-plugin" in efa.fix


def test_every_line_says_ok_or_gap_with_a_fix_and_duplicates_collapse() -> None:
    gap = checks.Finding("x", False, "broken", "mend it")
    assert gap.line() == "GAP  x: broken -> fix: mend it"
    assert checks.Finding("x", True, "fine").line() == "OK   x: fine"
    assert checks._dedupe([gap, gap]) == [gap]


def test_an_unusable_kubeconfig_or_server_exits_2_saying_which(tmp_path, capsys) -> None:
    from kvferry.tools.doctor import cli

    cr = tmp_path / "cr.yaml"
    cr.write_text(
        "apiVersion: kvferry.io/v1alpha1\nkind: DisaggregatedInference\n"
        "metadata: {name: a}\nspec: {model: /m}\n"
    )
    assert cli.main([str(cr), "--kubeconfig", str(tmp_path / "absent")]) == 2
    assert "cannot load the kubeconfig" in capsys.readouterr().err
    kubeconfig = tmp_path / "kc.yaml"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: x}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    assert cli.main([str(cr), "--kubeconfig", str(kubeconfig)]) == 2
    assert "cannot reach the API server" in capsys.readouterr().err
