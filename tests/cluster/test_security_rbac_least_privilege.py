"""What the operator's and the router's ServiceAccounts may do, asked of the real API server
(SelfSubjectRulesReview as each account), compared with an allowed list written out here by hand:
a new permission in codegen/rbac.py or the router's Role fails this test until it is reviewed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kvferry.operator.render.objects import render
from kvferry.operator.spec import names

from tests.unit.operator.cases import make_inference

pytestmark = pytest.mark.cluster

CRUD = ("get", "list", "watch", "create", "patch")
READ = ("get", "list", "watch")


def triples(group: str, resources: tuple[str, ...], verbs: tuple[str, ...]) -> set[tuple[str, str, str]]:
    return {(group, r, v) for r in resources for v in verbs}


OPERATOR_ALLOWED = (
    triples("apiextensions.k8s.io", ("customresourcedefinitions",), READ)
    | triples("", ("namespaces",), READ)
    # create: the operator makes its own peering object at start-up (operator/runtime/peering.py)
    | triples("kopf.dev", ("clusterkopfpeerings", "kopfpeerings"), (*READ, "create", "patch"))
    | triples("", ("events",), ("create",))
    | triples("events.k8s.io", ("events",), ("create",))
    | triples("kvferry.io", ("disaggregatedinferences",), (*READ, "patch"))
    | triples("kvferry.io", ("disaggregatedinferences/status",), ("get", "patch"))
    | triples("apps", ("statefulsets", "deployments"), CRUD)
    # spec.autoscaling writes replicas through the scale subresource only (operator/autoscale/writer.py)
    | triples("apps", ("statefulsets/scale",), ("get", "patch"))
    # a role wider than one node is a LeaderWorkerSet (operator/render/groups.py); no list/watch
    | triples("leaderworkerset.x-k8s.io", ("leaderworkersets",), ("get", "create", "patch"))
    # efaAttach: dra applies a role's ResourceClaimTemplate (operator/render/dra.py); no list/watch
    | triples("resource.k8s.io", ("resourceclaimtemplates",), ("get", "create", "patch"))
    # gang kueue: GangAdmitted reads the pod group's Workload (operator/status/gang.py); get only
    | triples("kueue.x-k8s.io", ("workloads",), ("get",))
    | triples("", ("services", "configmaps", "serviceaccounts"), CRUD)
    | triples("policy", ("poddisruptionbudgets",), CRUD)
    | triples("rbac.authorization.k8s.io", ("roles", "rolebindings"), CRUD)
    | triples("networking.k8s.io", ("networkpolicies",), CRUD)
    # existence check, metadata only; create: each CR's transfer token once. Never list/watch/update
    | triples("", ("secrets",), ("get", "create"))
    | triples("", ("pods",), READ)
    # the EC2 network-node labels of an engine pod's node, copied onto the pod (operator/reconcile/network.py)
    | triples("", ("pods",), ("patch",))
    | triples("", ("nodes",), ("get",))
    | triples("discovery.k8s.io", ("endpointslices",), READ)
)
ROUTER_ALLOWED = triples("discovery.k8s.io", ("endpointslices",), ("list",)) | triples(
    "", ("pods",), ("list",)
)
# What every authenticated user may do (system:basic-user): not granted by us.
EVERYONE = triples(
    "authorization.k8s.io", ("selfsubjectaccessreviews", "selfsubjectrulesreviews"), ("create",)
)
EVERYONE |= triples("authentication.k8s.io", ("selfsubjectreviews",), ("create",))


def granted(kubeconfig: Path, namespace: str) -> set[tuple[str, str, str]]:
    """Every (group, resource, verb) the kubeconfig's subject holds in `namespace`, expanded."""
    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        review = client.AuthorizationV1Api(api).create_self_subject_rules_review(
            {"spec": {"namespace": namespace}}
        )
    finally:
        api.close()
    assert not review.status.incomplete, review.status.evaluation_error
    out: set[tuple[str, str, str]] = set()
    for rule in review.status.resource_rules:
        assert not rule.resource_names, f"unexpected resourceNames rule: {rule}"
        out |= {(g, r, v) for g in rule.api_groups for r in rule.resources for v in rule.verbs}
    return out - EVERYONE


def diff(got: set[Any], allowed: set[Any]) -> str:
    return f"extra: {sorted(got - allowed)}\nmissing: {sorted(allowed - got)}"


def test_operator_service_account_holds_exactly_the_reviewed_rules(operator_kubeconfig, namespace) -> None:
    got = granted(operator_kubeconfig, namespace)
    assert got == OPERATOR_ALLOWED, diff(got, OPERATOR_ALLOWED)
    assert not any("*" in part for t in got for part in t)
    assert not {v for *_, v in got} & {
        "delete",
        "deletecollection",
        "update",
        "escalate",
        "bind",
        "impersonate",
    }
    assert ("", "secrets", "list") not in got and ("", "secrets", "watch") not in got


def test_router_service_account_only_lists_endpointslices_and_pods(control_plane, namespace) -> None:
    cr = make_inference("rbac", namespace=namespace).obj()
    rbac_objs = [o for o in render(cr).objects if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert len(rbac_objs) == 3
    docs = "\n---\n".join(yaml.safe_dump(o) for o in rbac_objs)
    control_plane.kubectl("apply", "--server-side", "--field-manager=kvferry", "-f", "-", input=docs)
    router_sa = names.router_name("rbac")
    kubeconfig = control_plane.sa_kubeconfig(namespace, router_sa, create=False)
    got = granted(kubeconfig, namespace)
    assert got == ROUTER_ALLOWED, diff(got, ROUTER_ALLOWED)
    # And nothing in any other namespace (its Role is namespaced).
    assert granted(kubeconfig, "default") == set()
