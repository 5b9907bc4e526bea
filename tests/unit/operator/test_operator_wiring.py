"""Pure parts of the operator runtime: drift detection, config parsing, RBAC coverage, handler registry."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import kopf
import pytest
from kvferry.codegen import rbac
from kvferry.operator.reconcile.drift import drifted, is_subset, quantity
from kvferry.operator.render.objects import render
from kvferry.operator.runtime import handlers
from kvferry.operator.runtime.config import OperatorConfig
from kvferry.operator.runtime.run import parse

from tests.unit.operator.cases import make_inference


def _sts() -> dict:
    objs = render(make_inference("d").obj()).objects
    return next(o for o in objs if o["kind"] == "StatefulSet")


def test_server_defaults_are_not_drift_but_hand_edits_are() -> None:
    desired = _sts()
    actual = copy.deepcopy(desired)
    actual["spec"]["updateStrategy"]["rollingUpdate"] = {"partition": 0}  # API server default
    actual["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    actual["metadata"]["labels"]["extra"] = "x"
    assert not drifted(desired, actual)
    actual["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    assert drifted(desired, actual)


def test_subset_compares_quantities_as_strings_and_lists_by_length() -> None:
    assert is_subset({"a": 2}, {"a": "2", "b": 1})
    assert not is_subset([1, 2], [1, 2, 3])
    assert not is_subset({"a": {"b": 1}}, {"a": {}})


def _pruned(obj):
    """What the API server stores: empty maps and lists dropped."""
    if isinstance(obj, dict):
        kept = {k: _pruned(v) for k, v in obj.items()}
        return {k: v for k, v in kept.items() if v not in ({}, [])}
    if isinstance(obj, list):
        return [_pruned(v) for v in obj]
    return obj


def test_empty_maps_the_server_prunes_are_not_drift() -> None:
    # accelerator none without resources renders `resources: {requests: {}, limits: {}}`; the stored
    # object has neither, and treating that as drift re-applied every such StatefulSet forever.
    for obj in render(make_inference("n", accelerator="none", image="i:1").obj()).objects:
        assert not drifted(obj, _pruned(obj)), obj["kind"]
    assert is_subset({"requests": {}}, {}) and is_subset({"a": []}, {})
    assert not is_subset({"a": [1]}, {}) and not is_subset({"a": "x"}, {})


def test_config_from_env_and_flags() -> None:
    cfg = OperatorConfig.from_env(
        {"KVFERRY_NAMESPACES": "a, b", "KVFERRY_STANDALONE": "true", "KVFERRY_METRICS_INTERVAL": "5"}
    )
    assert (cfg.namespaces, cfg.standalone, cfg.metrics_interval) == (("a", "b"), True, 5.0)
    with pytest.raises(ValueError, match="KVFERRY_METRICS_INTERVAL"):
        OperatorConfig.from_env({"KVFERRY_METRICS_INTERVAL": "soon"})
    with pytest.raises(ValueError, match=r"KVFERRY_RESYNC_INTERVAL='0': expected float > 0"):
        OperatorConfig.from_env({"KVFERRY_RESYNC_INTERVAL": "0"})
    with pytest.raises(ValueError, match=r"KVFERRY_METRICS_PORT='70000': expected int <= 65535"):
        OperatorConfig.from_env({"KVFERRY_METRICS_PORT": "70000"})
    with pytest.raises(ValueError, match="metrics URL 'ftp://x': must start with http"):
        OperatorConfig.from_env({"KVFERRY_METRICS_URL": "ftp://x"})
    # an empty variable is unset (the default), not an empty value
    assert OperatorConfig.from_env({"KVFERRY_ROUTER_IMAGE": "", "KVFERRY_STANDALONE": ""}) == OperatorConfig()
    cfg, verbose = parse(["-n", "x", "-n", "y", "--standalone", "--priority", "7"])
    assert (cfg.namespaces, cfg.standalone, cfg.priority, verbose) == (("x", "y"), True, 7, False)
    with pytest.raises(SystemExit):
        parse(["-n", "x", "--all-namespaces"])


def test_namespaces_env_survives_flag_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    # The chart sets KVFERRY_NAMESPACES; an absent flag must not reset it to cluster-wide.
    monkeypatch.setenv("KVFERRY_NAMESPACES", "a,b")
    assert parse([])[0].namespaces == ("a", "b")
    assert parse(["-n", "c"])[0].namespaces == ("c",)
    assert parse(["--all-namespaces"])[0].namespaces == ()


def test_rbac_covers_every_rendered_kind_with_apply_verbs() -> None:
    plural = {
        "ConfigMap": "configmaps",
        "ServiceAccount": "serviceaccounts",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "Service": "services",
        "StatefulSet": "statefulsets",
        "PodDisruptionBudget": "poddisruptionbudgets",
        "Deployment": "deployments",
        "NetworkPolicy": "networkpolicies",
    }
    granted = {(g, r): set(v) for gs, rs, v, _ in rbac.RULES for g in gs for r in rs}
    for obj in render(make_inference("r").obj()).objects:
        group = obj["apiVersion"].rpartition("/")[0]
        verbs = granted.get((group, plural[obj["kind"]]), set())
        assert {"patch", "create", "get", "watch"} <= verbs, obj["kind"]
    assert all(why for *_, why in rbac.RULES)
    assert "delete" not in {v for *_, verbs, _ in rbac.RULES for v in verbs}


def test_handlers_register_reconcile_owned_watches_and_timers() -> None:
    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorConfig(metrics_interval=3))
    ids = (
        {h.id for h in registry._spawning.get_all_handlers()}
        | {h.id for h in registry._changing.get_all_handlers()}
        | {h.id for h in registry._watching.get_all_handlers()}
        | {h.id for h in registry._indexing.get_all_handlers()}
    )
    assert {"reconcile", "transfer-status", "resync", "owned-statefulsets", "inferences", "owned"} <= ids


def test_indexes_and_the_event_sorter_run_on_the_event_loop_not_the_reconcile_threads() -> None:
    # kopf runs sync handlers on its 8 threads: there, every watch event of 14,000 objects waited behind
    # reconciles blocked on the API server, and the queued events' bodies were most of 1.1 GiB.
    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorConfig())
    watch_side = [*registry._indexing.get_all_handlers(), *registry._watching.get_all_handlers()]
    assert {h.id for h in watch_side} >= {"inferences", "owned", "copies", "owned-statefulsets"}
    assert all(inspect.iscoroutinefunction(h.fn) for h in watch_side), [h.id for h in watch_side]


def test_every_setting_is_documented() -> None:
    from kvferry.operator.runtime.config import describe

    text = (Path(__file__).resolve().parents[3] / "docs/operator.md").read_text()
    missing = [env for _, env, _, _ in describe() if f"`{env}`" not in text]
    assert not missing, f"docs/operator.md lacks {missing}"


def test_quantities_compare_as_values_where_fields_hold_quantities() -> None:
    # What the API server stores for what we render: 8 x 640Mi hugepages -> 5Gi, 1000m cpu -> 1.
    res = {"limits": {"hugepages-2Mi": "5120Mi", "cpu": "1000m", "memory": "0.5Gi"}, "requests": {"cpu": "8"}}
    stored = {"limits": {"hugepages-2Mi": "5Gi", "cpu": "1", "memory": "512Mi"}, "requests": {"cpu": 8}}
    assert is_subset({"resources": res}, {"resources": stored})
    assert is_subset({"emptyDir": {"sizeLimit": "20480Mi"}}, {"emptyDir": {"sizeLimit": "20Gi"}})
    assert not is_subset({"limits": {"cpu": "1001m"}}, {"limits": {"cpu": "1"}}, "resources")
    assert not is_subset({"image": "1000m"}, {"image": "1"})  # only quantity fields compare as values
    assert quantity("1e3") == quantity("1k") == 1000 and quantity("abc") is None


def test_every_preset_render_matches_its_canonical_stored_form() -> None:
    """Each rendered quantity, rewritten the way the API server canonicalises it, is still no drift."""
    for accel in ("p5en", "p5", "trn2", "trn1", "cpu"):
        tp = 8 if accel != "cpu" else 1
        builder = make_inference("c", accelerator=accel).prefill(tensorParallelSize=tp)
        if accel.startswith("trn"):  # Neuron runs the upstream connector in pull mode only
            builder.kv(connector="vllm", mode="pull").decode(tensorParallelSize=tp)
        for obj in render(builder.obj()).objects:
            assert not drifted(obj, _canonical(obj)), (accel, obj["kind"])


def _canonical(obj, key: str = ""):
    """Quantities as the API server prints them: the largest binary suffix that divides, else millis."""
    if isinstance(obj, dict):
        return {k: _canonical(v, k if key not in ("requests", "limits") else key) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_canonical(v, key) for v in obj]
    if key in ("requests", "limits", "sizeLimit") and (q := quantity(obj)) is not None:
        for suffix, mult in (("Gi", 2**30), ("Mi", 2**20)):
            if q and q % mult == 0:
                return f"{q // mult}{suffix}"
        return str(int(q)) if q.denominator == 1 else f"{int(q * 1000)}m"
    return obj
