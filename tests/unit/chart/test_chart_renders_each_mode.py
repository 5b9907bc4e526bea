"""The chart rendered by the real `helm` binary, one behaviour per test (cert-manager-style chart tests).

Offline: `helm template`/`helm lint` only. tests/cluster/test_install_*.py sends the output to a real
API server.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kvferry.codegen import crdgen, generate, helm
from kvferry.operator.render import images

CHART = generate.ROOT / generate.CHART
CRD_NAMES = {
    "disaggregatedinferences.kvferry.io",
    "kopfpeerings.kopf.dev",
    "clusterkopfpeerings.kopf.dev",
}


def render(
    *set_values: str, namespace: str = "kvferry-system", registry: str | None = images.DEFAULT_REGISTRY
) -> list[dict[str, Any]]:
    """The chart rendered with `set_values` over a registry (it requires one; None: leave it unset)."""
    given = (f"image.registry={registry}",) if registry is not None else ()
    text = helm.template(CHART, namespace=namespace, set_values=(*given, *set_values))
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def resources_granted(role: dict[str, Any]) -> set[str]:
    return {res for rule in role["rules"] for res in rule["resources"]}


def test_lint_is_clean_in_every_mode(tmp_path) -> None:
    namespaced = tmp_path / "namespaced.yaml"
    namespaced.write_text(
        "operator: {watch: {scope: namespaces, namespaces: [a, b]}, replicas: 2,"
        " leaderElection: {enabled: true}}\n"
    )
    registry = tmp_path / "registry.yaml"  # the chart requires one
    registry.write_text(f"image: {{registry: {images.DEFAULT_REGISTRY}}}\n")
    helm.lint(CHART, values=[registry])
    helm.lint(CHART, values=[registry, namespaced])


def test_default_render_has_exactly_the_expected_objects() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in render())
    assert kinds == sorted(
        [
            ("ClusterRole", "kvferry"),
            ("ClusterRoleBinding", "kvferry"),
            ("Deployment", "kvferry"),
            ("Service", "kvferry-metrics"),
            ("ServiceAccount", "kvferry"),
            *[("CustomResourceDefinition", name) for name in CRD_NAMES],
        ]
    )


def test_operator_pod_is_locked_down() -> None:
    docs = render()
    pod = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(docs)
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["port"] == "healthz"
    assert container["resources"]["limits"]["memory"] == "512Mi"


def test_cluster_scope_watches_all_namespaces_through_one_cluster_role() -> None:
    docs = render()
    assert operator_container(docs)["args"] == ["--all-namespaces"]
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert {"disaggregatedinferences", "statefulsets"} <= resources_granted(cluster_role)


def test_namespaced_scope_grants_workload_access_only_in_the_watched_namespaces() -> None:
    docs = render("operator.watch.scope=namespaces", "operator.watch.namespaces={team-a,team-b}")
    assert operator_container(docs)["args"] == ["--namespace=team-a", "--namespace=team-b"]
    roles = {
        r["metadata"]["namespace"]: r for r in by_kind(docs, "Role") if r["metadata"]["name"] == "kvferry"
    }
    assert set(roles) == {"team-a", "team-b"}
    for role in roles.values():
        assert {"disaggregatedinferences", "statefulsets"} <= resources_granted(role)
    # only cluster-scoped reads stay cluster-wide: kopf's, and nodes (their network labels: network.py)
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert resources_granted(cluster_role) == {"customresourcedefinitions", "namespaces", "nodes"}
    assert {v for rule in cluster_role["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}


def test_namespaced_scope_defaults_to_the_release_namespace() -> None:
    docs = render("operator.watch.scope=namespaces", namespace="inference")
    assert operator_container(docs)["args"] == ["--namespace=inference"]


def test_crds_are_kept_on_uninstall_by_default_and_can_be_left_out() -> None:
    crds = by_kind(render(), "CustomResourceDefinition")
    assert {c["metadata"]["name"] for c in crds} == CRD_NAMES
    assert all(c["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for c in crds)
    unkept = by_kind(render("crds.keep=false"), "CustomResourceDefinition")
    assert all("annotations" not in c["metadata"] for c in unkept)
    assert by_kind(render("crds.enabled=false"), "CustomResourceDefinition") == []


def test_chart_crd_is_the_generated_crd() -> None:
    source = crdgen.crd()
    (rendered,) = [
        c for c in by_kind(render(), "CustomResourceDefinition") if c["spec"]["group"] == "kvferry.io"
    ]
    assert rendered["spec"] == source["spec"]


def test_two_replicas_need_leader_election() -> None:
    with pytest.raises(helm.HelmError, match="operator.replicas > 1 needs operator.leaderElection.enabled"):
        render("operator.replicas=2", "operator.leaderElection.enabled=false")
    (deployment,) = by_kind(
        render("operator.replicas=2", "operator.leaderElection.enabled=true"), "Deployment"
    )
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVFERRY_PEERING"] == "kvferry"


def test_a_standalone_operator_is_replaced_without_overlap() -> None:
    (deployment,) = by_kind(render(), "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVFERRY_STANDALONE"] == "true" and "KVFERRY_PEERING" not in env


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("operator.replicas=two", "at '/operator/replicas': got string, want integer"),
        ("operator.replica=2", "at '/operator': additional properties 'replica' not allowed"),
        ("operator.watch.scope=everywhere", "at '/operator/watch/scope': value must be one of"),
    ],
)
def test_bad_values_fail_with_a_message_naming_the_key(setting: str, message: str) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(setting)
    helm_said = str(err.value).split("failed (exit", 1)[1]  # past the echoed command line
    assert "don't meet the specifications of the schema" in helm_said
    assert message in helm_said


def test_service_monitor_is_opt_in() -> None:
    assert by_kind(render(), "ServiceMonitor") == []
    (monitor,) = by_kind(
        render("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom"),
        "ServiceMonitor",
    )
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_an_unset_registry_refuses_to_render_and_says_why() -> None:
    # No kvferry image is published: a default registry would render pods stuck in ImagePullBackOff.
    with pytest.raises(helm.HelmError, match="image.registry is required: no kvferry image is published"):
        render(registry=None)


def test_one_registry_value_names_the_operator_router_and_engine_images() -> None:
    def env(container: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: e.get("value") for e in container["env"]}

    moved = operator_container(render("image.registry=registry.example.com/team/kvferry"))
    assert moved["image"] == images.operator_image("registry.example.com/team/kvferry")
    assert env(moved)["KVFERRY_ROUTER_IMAGE"] == moved["image"]  # routers and injectors run it too
    assert env(moved)["KVFERRY_IMAGE_REGISTRY"] == "registry.example.com/team/kvferry"


def test_image_digest_wins_over_the_tag() -> None:
    digest = "sha256:" + "a" * 64
    image = operator_container(render(f"operator.image.digest={digest}", "operator.image.tag=9.9.9"))["image"]
    assert image.endswith("@" + digest)
    assert operator_container(render())["image"].endswith(":0.1.0")
