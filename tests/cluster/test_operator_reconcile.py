"""The operator, as a real subprocess under its own ServiceAccount, turns CRs into working P/D services:
objects with owner references, scheduling on the fake EFA nodes, scaling, rollouts, drift correction,
garbage collection and crash recovery."""

from __future__ import annotations

import json
import signal

import pytest
from kvferry.operator.render.objects import render
from kvferry.operator.spec import names

from tests.cluster.operator_fixtures import EXPECTED_KINDS, kinds_of
from tests.unit.operator.cases import make_inference
from tests.waiting import wait_until

PRESETS = {
    "p5en": make_inference("pa", accelerator="p5en")
    .prefill(tensorParallelSize=2)
    .decode(tensorParallelSize=4),
    "p5": make_inference("pb", accelerator="p5"),
    "trn2": make_inference("pc", accelerator="trn2")
    .kv(connector="vllm", mode="pull")
    .prefill(tensorParallelSize=4)
    .decode(tensorParallelSize=8),
    "trn1": make_inference("pd", accelerator="trn1").kv(connector="vllm", mode="pull"),
    "cpu": make_inference("pe"),
    "none": make_inference("pf", accelerator="none", image="registry.example/vllm:1"),
}


def test_each_preset_becomes_every_object_with_owner_references(cluster, operator) -> None:
    for builder in PRESETS.values():
        cluster.apply(builder.obj())
    for preset, builder in PRESETS.items():
        cr_obj = builder.obj()
        name = cr_obj["metadata"]["name"]
        objs = wait_until(
            lambda n=name: (o := cluster.owned(n)) and kinds_of(o) == EXPECTED_KINDS and o,
            f"all objects of {preset}",
        )
        uid = cluster.cr(name)["metadata"]["uid"]
        for (kind, obj_name), obj in objs.items():
            (ref,) = obj["metadata"]["ownerReferences"]
            assert (ref["uid"], ref["controller"], ref["blockOwnerDeletion"]) == (uid, True, True), (
                kind,
                obj_name,
            )
        # The stored StatefulSets carry exactly what render() asks for (spot-check the fields that matter).
        cr_obj["metadata"]["namespace"] = cluster.ns
        want = {(o["kind"], o["metadata"]["name"]): o for o in render(cr_obj).objects}
        for role in names.ROLES:
            key = ("StatefulSet", f"{name}-{role}")
            got_c, want_c = (x["spec"]["template"]["spec"]["containers"][0] for x in (objs[key], want[key]))
            assert got_c["image"] == want_c["image"] and got_c["args"] == want_c["args"], preset
            for k, v in want_c["resources"].get("limits", {}).items():
                assert str(got_c["resources"]["limits"][k]) == str(v), (preset, k)
            labels = objs[key]["spec"]["template"]["metadata"]["labels"]
            assert labels[names.LABEL_REVISION] == want[key]["metadata"]["labels"][names.LABEL_REVISION]
        assert objs[("Service", name)]["spec"]["ports"][0]["port"] == names.HTTP_PORT
        assert objs[("Service", f"{name}-prefill")]["spec"]["clusterIP"] == "None"
    assert cluster.get("statefulset", "pc-decode")["spec"]["template"]["spec"]["tolerations"][0]["key"] == (
        "aws.amazon.com/neuron"
    )


def test_p5en_pods_land_on_p5en_nodes_with_efa_and_the_cr_turns_ready(cluster, operator) -> None:
    cluster.apply(
        make_inference("q", accelerator="p5en")
        .prefill(replicas=2, tensorParallelSize=2)
        .decode(tensorParallelSize=4)
        .obj()
    )
    cluster.wait_ready("q", "CR q Ready")
    engines = cluster.pods("q", "prefill") + cluster.pods("q", "decode")
    assert len(engines) == 3
    for pod in engines:
        node = cluster.core.read_node(pod["spec"]["nodeName"])
        assert node.metadata.labels["node.kubernetes.io/instance-type"] == "p5en.48xlarge"
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["vpc.amazonaws.com/efa"]) == 2 * int(limits["nvidia.com/gpu"])
    status = cluster.cr("q")["status"]
    assert (status["prefill"]["summary"], status["decode"]["summary"]) == ("2/2", "1/1")
    assert status["endpoint"] == f"http://q.{cluster.ns}.svc:8000"
    revisions = {p["metadata"]["labels"][names.LABEL_REVISION] for p in engines}
    assert revisions == {status["revision"]}


def test_efa_through_dra_applies_the_claim_template_the_pods_name(cluster, operator) -> None:
    """efaAttach: dra renders a ResourceClaimTemplate (render/dra.py); the operator applies it like
    every object it makes, owned by the CR, and the role's pods claim from it."""
    cr = make_inference("dr", accelerator="p5en").prefill(tensorParallelSize=2, efaAttach="dra").obj()
    cluster.apply(cr)
    cr["metadata"]["namespace"] = cluster.ns
    (want,) = [o for o in render(cr).objects if o["kind"] == "ResourceClaimTemplate"]
    name = want["metadata"]["name"]
    got = wait_until(lambda: cluster.get("resourceclaimtemplate", name), f"ResourceClaimTemplate {name}")
    (ref,) = got["metadata"]["ownerReferences"]
    assert ref["uid"] == cluster.cr("dr")["metadata"]["uid"] and ref["controller"] is True

    def requests(spec: dict) -> list[tuple]:  # the API server adds defaults (allocationMode, metadata)
        devices = spec["spec"]["devices"]
        asked = [
            (r["name"], r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in devices["requests"]
        ]
        return asked + [(tuple(c["requests"]), c["matchAttribute"]) for c in devices["constraints"]]

    assert requests(got["spec"]) == requests(want["spec"])
    sts = wait_until(lambda: cluster.get("statefulset", "dr-prefill"), "prefill StatefulSet")
    claims = sts["spec"]["template"]["spec"]["resourceClaims"]
    assert [c["resourceClaimTemplateName"] for c in claims] == [name]


def test_scale_decode_with_kubectl_scale_and_prefill_with_a_patch(cluster, operator) -> None:
    # No preset: pods request nothing, so 2 prefill + 3 decode fit the one small cpu node.
    cluster.apply(make_inference("s", accelerator="none", image="vllm:1").obj())
    cluster.wait_ready("s", "CR s Ready")
    cluster.kubectl("scale", "disaggregatedinference/s", "--replicas=3")
    cluster.kubectl(
        "patch", "disaggregatedinference/s", "--type=merge", "-p", '{"spec":{"prefill":{"replicas":2}}}'
    )
    wait_until(lambda: cluster.get("statefulset", "s-decode")["spec"]["replicas"] == 3, "decode scaled to 3")
    wait_until(
        lambda: cluster.get("statefulset", "s-prefill")["spec"]["replicas"] == 2, "prefill scaled to 2"
    )
    wait_until(
        lambda: cluster.ready("s") and cluster.cr("s")["status"]["decode"]["readyReplicas"] == 3,
        "ready at the new size",
    )
    scale = json.loads(
        cluster.kubectl(
            "get",
            "--raw",
            f"/apis/kvferry.io/v1alpha1/namespaces/{cluster.ns}/disaggregatedinferences/s/scale",
        ).stdout
    )
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)
    assert scale["status"]["selector"] == f"{names.LABEL_NAME}=s,{names.LABEL_ROLE}=decode"


def test_image_change_rolls_both_roles_progressing_then_ready(cluster, operator, status_log) -> None:
    cluster.apply(make_inference("img", image="vllm:one").obj())
    cluster.wait_ready("img", "CR img Ready")
    old_rev = cluster.cr("img")["status"]["revision"]
    cluster.kubectl(
        "patch", "disaggregatedinference/img", "--type=merge", "-p", '{"spec":{"image":"vllm:two"}}'
    )
    generation = cluster.cr("img")["metadata"]["generation"]
    # kwok pods roll in about a second: a poll can miss Progressing=True, the watch of every stored
    # version cannot.
    wait_until(
        lambda: status_log.seen("img", "Progressing", "True", generation),
        "Progressing=True stored for the new generation",
    )
    cluster.wait_ready("img", "Ready again after the rollout", timeout_s=120)
    status = cluster.cr("img")["status"]
    assert status["observedGeneration"] == generation and status["revision"] != old_rev
    for pod in cluster.pods("img", "prefill") + cluster.pods("img", "decode"):
        assert pod["spec"]["containers"][0]["image"] == "vllm:two"
        assert pod["metadata"]["labels"][names.LABEL_REVISION] == status["revision"]
    assert cluster.events("RolloutStarted")


def test_hand_edit_of_a_managed_statefulset_is_reverted(cluster, operator) -> None:
    cluster.apply(make_inference("drift").obj())
    cluster.wait_ready("drift", "CR drift Ready")
    want = cluster.get("statefulset", "drift-decode")["spec"]["template"]["spec"]["containers"][0]["image"]
    cluster.kubectl(
        "patch",
        "statefulset/drift-decode",
        "--type=json",
        "-p",
        '[{"op":"replace","path":"/spec/template/spec/containers/0/image","value":"evil:1"}]',
    )
    wait_until(
        lambda: (
            cluster.get("statefulset", "drift-decode")["spec"]["template"]["spec"]["containers"][0]["image"]
            == want
        ),
        "image reverted",
    )
    cluster.kubectl("delete", "configmap", "drift-config")
    wait_until(lambda: cluster.get("configmap", "drift-config"), "deleted ConfigMap re-created")
    assert wait_until(lambda: cluster.events("DriftCorrected"), "DriftCorrected event")


def test_deleting_the_cr_removes_everything_it_made(cluster, operator) -> None:
    cluster.apply(make_inference("gone").obj())
    wait_until(lambda: kinds_of(cluster.owned("gone")) == EXPECTED_KINDS, "objects of gone")
    cluster.kubectl("delete", "disaggregatedinference", "gone", "--wait=true", "--timeout=30s")
    wait_until(lambda: not cluster.owned("gone") and not cluster.pods("gone"), "garbage collection", 90)


def test_operator_killed_mid_reconcile_converges_after_restart(cluster, start_operator) -> None:
    slow = start_operator(env={"KVFERRY_APPLY_PAUSE_SECONDS": "1.5"})
    cluster.apply(make_inference("crash").decode(replicas=2).obj())
    wait_until(lambda: ("ConfigMap", "crash-config") in cluster.owned("crash"), "first object applied")
    slow.stop(signal.SIGKILL)
    partial = kinds_of(cluster.owned("crash"))
    assert partial != EXPECTED_KINDS, f"reconcile finished before the kill: {partial}"
    start_operator()
    wait_until(lambda: kinds_of(cluster.owned("crash")) == EXPECTED_KINDS, "all objects after restart")
    cluster.wait_ready("crash", "Ready after restart", 90)


def test_the_operator_service_account_is_not_cluster_admin(control_plane, operator_kubeconfig) -> None:
    # The RBAC is real: what the rules leave out is refused (so "no 403" above means the rules suffice).
    res = control_plane.kubectl(
        f"--kubeconfig={operator_kubeconfig}", "auth", "can-i", "delete", "statefulsets", "-A", check=False
    )
    assert res.stdout.strip() == "no"
    res = control_plane.kubectl(
        f"--kubeconfig={operator_kubeconfig}",
        "auth",
        "can-i",
        "patch",
        "disaggregatedinferences.kvferry.io/status",
        "-A",
        check=False,
    )
    assert res.stdout.strip() == "yes"


@pytest.mark.parametrize("owner", ["autoscaler"])
def test_autoscaler_owned_replicas_are_left_alone(cluster, operator, owner) -> None:
    cluster.apply(make_inference("hpa").decode(replicas=1, replicasOwner=owner).obj())
    cluster.wait_ready("hpa", "CR hpa Ready")
    cluster.kubectl("scale", "statefulset/hpa-decode", "--replicas=2")  # what an HPA does
    wait_until(lambda: cluster.cr("hpa")["status"]["decode"]["readyReplicas"] == 2, "2 decode pods ready")
    cluster.kubectl("annotate", "disaggregatedinference/hpa", "touch=1")  # any CR change re-reconciles
    cluster.kubectl(
        "patch", "disaggregatedinference/hpa", "--type=merge", "-p", '{"spec":{"router":{"replicas":2}}}'
    )
    wait_until(lambda: cluster.get("deployment", "hpa-router")["spec"]["replicas"] == 2, "router scaled")
    assert cluster.get("statefulset", "hpa-decode")["spec"]["replicas"] == 2
    cluster.wait_ready("hpa", "Ready with the autoscaler's replica count")
