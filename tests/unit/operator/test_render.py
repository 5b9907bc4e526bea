"""render(): what each preset puts on the pods, revision pairing, ownership, autoscaler replicas."""

from __future__ import annotations

import json

import pytest
from kvferry.operator.render.objects import render
from kvferry.operator.spec import names

from tests.unit.operator.cases import make_inference


def _objects(cr: dict, **kw) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render(cr, **kw).objects}


def _engine(objs: dict, name: str) -> dict:
    return objs[("StatefulSet", name)]["spec"]["template"]["spec"]


def _kv(container: dict) -> dict:
    return json.loads(container["args"][container["args"].index("--kv-transfer-config") + 1])


def test_p5en_pods_get_gpus_efa_libfabric_ipc_lock_and_the_instance_selector() -> None:
    cr = (
        make_inference("q", accelerator="p5en")
        .prefill(tensorParallelSize=2)
        .decode(tensorParallelSize=8)
        .obj()
    )
    objs = _objects(cr)
    decode = _engine(objs, "q-decode")
    res = decode["containers"][0]["resources"]["limits"]
    assert (res["nvidia.com/gpu"], res["vpc.amazonaws.com/efa"]) == (8, 16)
    assert _engine(objs, "q-prefill")["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == 4
    assert decode["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5en.48xlarge"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in decode["tolerations"]
    assert decode["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert _kv(decode["containers"][0])["kv_connector_extra_config"]["backends"] == ["LIBFABRIC"]


def test_p5_hugepages_scale_with_tp_and_trn2_uses_neuron_devices() -> None:
    p5 = _engine(
        _objects(make_inference("a", accelerator="p5").decode(tensorParallelSize=4).obj()), "a-decode"
    )
    assert p5["containers"][0]["resources"]["limits"]["hugepages-2Mi"] == "2560Mi"
    trn = _engine(
        _objects(
            make_inference("b", accelerator="trn2")
            .kv(connector="vllm", mode="pull")
            .prefill(tensorParallelSize=16)
            .decode(tensorParallelSize=16)
            .obj()
        ),
        "b-prefill",
    )
    limits = trn["containers"][0]["resources"]["limits"]
    assert (limits["aws.amazon.com/neuron"], limits["vpc.amazonaws.com/efa"]) == (4, 4)
    assert trn["containers"][0]["image"].startswith("public.ecr.aws/neuron/")
    env = {e["name"]: e.get("value") for e in trn["containers"][0]["env"]}
    assert env["VLLM_NEURON_SKIP_DECODE_WARMUP"] == "1"


def test_engine_identity_comes_from_the_pod_and_both_roles_share_revision() -> None:
    objs = _objects(make_inference("i").obj())
    revs = set()
    for role in names.ROLES:
        pod = objs[("StatefulSet", f"i-{role}")]["spec"]["template"]
        container = pod["spec"]["containers"][0]
        kv = _kv(container)
        assert kv["engine_id"] == "$(POD_NAME)"
        assert kv["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
        assert [p["name"] for p in container["ports"]] == [
            "http",
            "side-channel",
            "kv-events",
            "kv-replay",
        ]
        revs.add(pod["metadata"]["labels"][names.LABEL_REVISION])
    assert len(revs) == 1


def test_revision_follows_shared_settings_only() -> None:
    base = render(make_inference("r").obj()).revision
    assert render(make_inference("r").decode(replicas=5).prefill(extraArgs=["--x"]).obj()).revision == base
    assert render(make_inference("r", image="vllm:new").obj()).revision != base
    assert render(make_inference("r").vllm(blockSize=32).obj()).revision != base


def test_owner_references_only_when_the_cr_has_a_uid() -> None:
    cr = make_inference("o", namespace="ns").obj()
    assert all("ownerReferences" not in o["metadata"] for o in render(cr).objects)
    cr["metadata"]["uid"] = "1234"
    for obj in render(cr).objects:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["controller"], ref["kind"]) == ("1234", True, "DisaggregatedInference")
        assert obj["metadata"]["namespace"] == "ns"


@pytest.mark.parametrize(("observed", "expected"), [(None, 2), (7, 7)])
def test_autoscaler_owned_replicas_keep_the_observed_value(observed, expected) -> None:
    cr = make_inference("h").decode(replicas=2, replicasOwner="autoscaler").prefill(replicas=3).obj()
    objs = _objects(cr, observed_replicas={"decode": observed, "prefill": 9})
    assert objs[("StatefulSet", "h-decode")]["spec"]["replicas"] == expected
    assert objs[("StatefulSet", "h-prefill")]["spec"]["replicas"] == 3  # spec-owned: spec wins


def test_router_config_matches_the_contract_and_rolls_the_router_on_change() -> None:
    import yaml

    objs = _objects(make_inference("c", namespace="ns").kv(connector="vllm").obj())
    cfg = yaml.safe_load(objs[("ConfigMap", "c-config")]["data"]["router.yaml"])
    assert cfg["mode"] == "vllm-push"
    kube = cfg["discovery"]["kubernetes"]
    assert (kube["prefill_service"], kube["decode_service"], kube["namespace"]) == (
        "c-prefill",
        "c-decode",
        "ns",
    )
    assert kube["revision_label"] == names.LABEL_REVISION
    hash1 = objs[("Deployment", "c-router")]["spec"]["template"]["metadata"]["annotations"]
    objs2 = _objects(
        make_inference("c", namespace="ns").kv(connector="vllm").router(policy="round-robin").obj()
    )
    assert objs2[("Deployment", "c-router")]["spec"]["template"]["metadata"]["annotations"] != hash1


def test_graceful_drain_covers_the_lease_on_prefill() -> None:
    objs = _objects(make_inference("d").kv(leaseSeconds=90, deadlineSeconds=30).obj())
    prefill = _engine(objs, "d-prefill")
    args = prefill["containers"][0]["args"]
    drain = int(args[args.index("--shutdown-timeout") + 1])
    assert drain >= 90
    assert (
        prefill["terminationGracePeriodSeconds"]
        > drain + prefill["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    )
    dshm = next(v for v in prefill["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory"


def test_names_are_truncated_to_63_with_a_hash() -> None:
    long = "a" * 80
    assert len(names.fit(long)) == 63
    assert names.fit(long) != names.fit("a" * 79 + "b")
    assert names.fit("short") == "short"


@pytest.mark.parametrize("accelerator", ["cpu", "p5en", "trn2", "none"])
def test_rendered_kinds_are_the_ones_tests_and_benchmarks_count(accelerator: str) -> None:
    from kvferry.operator.reconcile.apply import RENDERED_KINDS, RESOURCES

    builder = make_inference("k", accelerator=accelerator, image="i:1")
    if accelerator == "trn2":  # Neuron runs the upstream connector in pull mode only (rules.py)
        builder.kv(connector="vllm", mode="pull")
    kinds = {o["kind"] for o in render(builder.obj()).objects}
    assert kinds == set(RENDERED_KINDS)
    assert all(k in RESOURCES for k in RENDERED_KINDS)  # the operator's client knows each path


def test_every_kind_any_render_makes_has_a_path_in_the_operators_client() -> None:
    """Kinds rendered only by some specs (DRA claims, LeaderWorkerSets) are applied like the rest:
    an apply of a kind the client has no path for fails the whole reconcile."""
    from kvferry.operator.reconcile.apply import RESOURCES

    dra = make_inference("k", accelerator="p5en", image="i:1").prefill(tensorParallelSize=2, efaAttach="dra")
    kinds = {o["kind"] for o in render(dra.decode(efaAttach="dra").obj()).objects}
    assert "ResourceClaimTemplate" in kinds
    assert kinds <= set(RESOURCES)
