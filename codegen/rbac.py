"""RBAC step: the permissions the operator needs, as data, each rule with the reason it exists.

`kvferry generate` writes RULES into the chart (charts/kvferry/templates/_rbac-rules.tpl, each rule under
its reason) and so into manifests/install.yaml; the cluster tests run the operator under a ServiceAccount
bound to exactly these rules (`cluster_role()`).
"""

from __future__ import annotations

from typing import Any

from kvferry.operator.spec import GROUP, PLURAL

# (apiGroups, resources, verbs, why)
RULES: list[tuple[list[str], list[str], list[str], str]] = [
    # Framework (kopf)
    (
        ["apiextensions.k8s.io"],
        ["customresourcedefinitions"],
        ["get", "list", "watch"],
        "kopf: notice CRDs appearing/disappearing at runtime (cluster-wide mode)",
    ),
    ([""], ["namespaces"], ["get", "list", "watch"], "kopf: follow namespaces in cluster-wide mode"),
    (
        ["kopf.dev"],
        ["clusterkopfpeerings", "kopfpeerings"],
        ["get", "list", "watch", "create", "patch"],
        "kopf: peering = leader election between operator replicas (create: the operator makes its "
        "peering object at start-up, peering.py)",
    ),
    ([""], ["events"], ["create"], "kopf: post an event for every significant step"),
    (["events.k8s.io"], ["events"], ["create"], "kopf: post events (newer API)"),
    # Application
    (
        [GROUP],
        [PLURAL],
        ["get", "list", "watch", "patch"],
        "watch CRs; kopf keeps its progress in kvferry.io annotations (patch)",
    ),
    ([GROUP], [f"{PLURAL}/status"], ["get", "patch"], "write status (one merge patch per reconcile/scrape)"),
    (
        ["apps"],
        ["statefulsets", "deployments"],
        ["get", "list", "watch", "create", "patch"],
        "server-side apply of the engine StatefulSets and router Deployment (create: apply may create); "
        "watch to correct drift at once. No delete: owner references let the GC clean up",
    ),
    (
        ["leaderworkerset.x-k8s.io"],
        ["leaderworkersets"],
        ["get", "create", "patch"],
        "server-side apply of a role wider than one node as a LeaderWorkerSet (only rendered when a role "
        "spans nodes; the LWS controller makes its pods)",
    ),
    (
        ["resource.k8s.io"],
        ["resourceclaimtemplates"],
        ["get", "create", "patch"],
        "server-side apply of a role's ResourceClaimTemplate (only rendered for efaAttach dra; the "
        "resource-claim controller makes each pod's ResourceClaim from it)",
    ),
    (
        ["kueue.x-k8s.io"],
        ["workloads"],
        ["get"],
        "spec.placement.gang kueue: read the pod group's Workload so GangAdmitted says whether Kueue "
        "admitted prefill and decode or holds them (one get per reconcile and metrics interval)",
    ),
    (
        ["apps"],
        ["statefulsets/scale"],
        ["get", "patch"],
        "spec.autoscaling: the planner writes each role's replicas through its StatefulSet's scale "
        "subresource, and nothing else of the object",
    ),
    (
        [""],
        ["services", "configmaps", "serviceaccounts"],
        ["get", "list", "watch", "create", "patch"],
        "server-side apply of Services, the config ConfigMap and the router's ServiceAccount",
    ),
    (
        ["policy"],
        ["poddisruptionbudgets"],
        ["get", "list", "watch", "create", "patch"],
        "server-side apply of the per-role PodDisruptionBudgets",
    ),
    (
        ["rbac.authorization.k8s.io"],
        ["roles", "rolebindings"],
        ["get", "list", "watch", "create", "patch"],
        "server-side apply of the router's discovery Role and RoleBinding",
    ),
    (
        ["networking.k8s.io"],
        ["networkpolicies"],
        ["get", "list", "watch", "create", "patch"],
        "server-side apply of the per-CR NetworkPolicies (create: apply may create)",
    ),
    (
        [""],
        ["secrets"],
        ["get", "create"],
        "check that Secrets a CR references exist, reading metadata only (PartialObjectMetadata); "
        "create each CR's transfer token Secret once (<cr>-transfer-token, owned by the CR; never "
        "updated or deleted: the GC removes it with the CR). No list/watch/update. RBAC cannot narrow "
        "get to metadata or either verb to names known only at runtime (docs/security.md)",
    ),
    (
        [""],
        ["pods"],
        ["get", "list", "watch"],
        "find engine pods to read their metrics; also required to grant the router pods get/list/watch "
        "(RBAC lets a subject grant only what it holds)",
    ),
    (
        [""],
        ["pods"],
        ["patch"],
        "copy the EC2 network-node labels of an engine pod's node onto the pod (network.py), where the "
        "router reads them to pick the closest P/D pairs; only those labels, only on the CR's engine pods",
    ),
    (
        [""],
        ["nodes"],
        ["get"],
        "read the network-node labels (topology.k8s.aws/network-node-layer-1..3) of the nodes engine "
        "pods are bound to, once per node and hour; no list/watch",
    ),
    (
        ["discovery.k8s.io"],
        ["endpointslices"],
        ["get", "list", "watch"],
        "held only so the operator may grant it to the router's Role (same escalation rule)",
    ),
]


def rules() -> list[dict[str, Any]]:
    return [{"apiGroups": g, "resources": r, "verbs": v} for g, r, v, _ in RULES]


def cluster_role(name: str = "kvferry-operator") -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": rules(),
    }


def cluster_role_binding(sa_namespace: str, sa_name: str, role: str = "kvferry-operator") -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": f"{role}-{sa_namespace}-{sa_name}"[:253]},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": sa_namespace}],
    }
