"""Doctor checks (pure): a CR's needs + a snapshot of the cluster -> one Finding per check, gaps with fixes.

Sources of the fixes: shared/reference/efa-k8s.md §1 (device plugins, their charts' empty tolerations, the
EFA DRA driver), docs/trainium.md (the Neuron device plugin and scheduler extension), docs/eks-dra.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvferry.operator.render import dra
from kvferry.operator.spec import GROUP, PLURAL
from kvferry.tools.doctor.needs import EFA, GPU, NEURON, Needs, RoleNeeds

CRD = f"{PLURAL}.{GROUP}"
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
KUEUE_CRD = "workloads.kueue.x-k8s.io"
EFA_DRIVER = "dra.net"  # the EFA DRA driver's ResourceSlices (EKS "Manage EFA devices")
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")
# How each device plugin's DaemonSet is recognised (its chart's name or image), and how it is installed.
PLUGINS: dict[str, tuple[str, tuple[str, ...], str]] = {
    GPU: (
        "NVIDIA device plugin",
        ("nvidia-device-plugin", "nvidia/k8s-device-plugin"),
        "helm install nvdp nvdp/nvidia-device-plugin -n kube-system (>= 0.19: set MOFED off on EFA nodes)",
    ),
    EFA: (
        "EFA device plugin",
        ("efa-k8s-device-plugin",),
        "helm install efa eks/aws-efa-k8s-device-plugin -n kube-system",
    ),
    NEURON: (
        "Neuron device plugin",
        ("neuron-device-plugin",),
        "helm upgrade --install neuron-helm-chart oci://public.ecr.aws/neuron/neuron-helm-chart "
        "--set scheduler.enabled=true --set npd.enabled=false",
    ),
}
SCHEDULER_EXTENSION = "neuron-scheduler"  # the Neuron chart's extension Deployment (k8s-neuron-scheduler)


@dataclass(frozen=True)
class Finding:
    check: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        if self.ok:
            return f"OK   {self.check}: {self.detail}"
        return f"GAP  {self.check}: {self.detail} -> fix: {self.fix}"


@dataclass
class Snapshot:
    """What the doctor read from the cluster (cluster.py); raw API objects as dicts."""

    crds: set[str] = field(default_factory=set)
    operators: list[dict[str, Any]] = field(default_factory=list)  # the kvferry operator's Deployments
    nodes: list[dict[str, Any]] = field(default_factory=list)
    daemonsets: list[dict[str, Any]] = field(default_factory=list)
    deployments: list[dict[str, Any]] = field(default_factory=list)
    slices: list[dict[str, Any]] = field(default_factory=list)  # ResourceSlices (resource.k8s.io/v1)
    device_classes: set[str] = field(default_factory=set)  # DeviceClass names
    pods: list[dict[str, Any]] = field(default_factory=list)  # the CR's pods
    events: list[dict[str, Any]] = field(default_factory=list)  # events in the CR's namespace


def _name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata", {})
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta.get("name"))


def _ready(deployment: dict[str, Any]) -> bool:
    return int((deployment.get("status") or {}).get("readyReplicas") or 0) >= 1


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    """Kubernetes' toleration match (an empty key with Exists tolerates everything)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if not t.get("key"):
            if t.get("operator") == "Exists":
                return True
            continue
        if t["key"] != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _blocking(node: dict[str, Any], tolerations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    taints = (node.get("spec") or {}).get("taints") or []
    return [
        t for t in taints if t.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, t)
    ]


def _taint(t: dict[str, Any]) -> str:
    return f"{t['key']}={t.get('value', '')}:{t['effect']}"


def _toleration(t: dict[str, Any]) -> str:
    return f"{{key: {t['key']}, operator: Exists, effect: {t['effect']}}}"


def _selected(nodes: list[dict[str, Any]], selector: dict[str, str]) -> list[dict[str, Any]]:
    return [n for n in nodes if all(n["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]


def _allocatable(node: dict[str, Any], resource: str) -> int:
    value = (node.get("status") or {}).get("allocatable", {}).get(resource, "0")
    try:
        return int(value)
    except ValueError:
        return 0


def _slice_devices(slices: list[dict[str, Any]], node: str, driver: str) -> int:
    return sum(
        len(s["spec"].get("devices") or [])
        for s in slices
        if s["spec"].get("nodeName") == node and s["spec"].get("driver") == driver
    )


def check_control_plane(snap: Snapshot) -> list[Finding]:
    out = [
        Finding("crd", True, f"{CRD} is installed")
        if CRD in snap.crds
        else Finding(
            "crd",
            False,
            f"the CustomResourceDefinition {CRD} is not installed",
            "helm install kvferry charts/kvferry (or kubectl apply --server-side -f crds/)",
        )
    ]
    ready = [d for d in snap.operators if _ready(d)]
    if ready:
        out.append(Finding("operator", True, f"{', '.join(_name(d) for d in ready)} ready"))
    elif snap.operators:
        names = ", ".join(_name(d) for d in snap.operators)
        out.append(
            Finding(
                "operator",
                False,
                f"the operator Deployment {names} has no ready pod",
                f"kubectl describe deployment {names}; read its pods' events and logs",
            )
        )
    else:
        out.append(
            Finding(
                "operator",
                False,
                "no kvferry operator Deployment (labels app.kubernetes.io/name=kvferry, component=operator)",
                "helm install kvferry charts/kvferry --set image.registry=<your registry>",
            )
        )
    return out


def check_nodes(needs: RoleNeeds, snap: Snapshot) -> list[Finding]:
    """Nodes the role's pods can land on: selector, taints, then devices (plugins or DRA slices)."""
    check, role = f"nodes/{needs.role}", needs.role
    selector = ", ".join(f"{k}={v}" for k, v in needs.node_selector.items()) or "(any)"
    candidates = _selected(snap.nodes, needs.node_selector)
    if not candidates:
        return [
            Finding(
                check,
                False,
                f"no node labelled {selector}",
                "add nodes of that instance type (a node group or Karpenter NodePool), or change "
                f"spec.{role}.nodeSelector",
            )
        ]
    open_nodes = [n for n in candidates if not _blocking(n, needs.tolerations)]
    if not open_nodes:
        taints = sorted({_taint(t) for n in candidates for t in _blocking(n, needs.tolerations)})
        return [
            Finding(
                check,
                False,
                f"every node labelled {selector} has taints the pods do not tolerate: {', '.join(taints)}",
                f"add spec.{role}.tolerations for them",
            )
        ]
    if needs.dra_claim:
        return [_check_device_classes(needs, snap), _check_slices(needs, open_nodes, snap)]
    out = []
    for resource, count in sorted(needs.devices.items()):
        fitting = [n for n in open_nodes if _allocatable(n, resource) >= count]
        if fitting:
            out.append(
                Finding(f"{check}/{resource}", True, f"{len(fitting)} node(s) allocate {count} {resource}")
            )
            continue
        have = ", ".join(f"{n['metadata']['name']}: {_allocatable(n, resource)}" for n in open_nodes)
        fix = f"install the {PLUGINS[resource][0]} ({PLUGINS[resource][2]}), tolerating the nodes' taints"
        if resource == EFA and any(
            _slice_devices(snap.slices, n["metadata"]["name"], EFA_DRIVER) for n in open_nodes
        ):
            fix = (
                f"the nodes hand out EFA through the EFA DRA driver (dra.net): set spec.{role}.efaAttach: dra"
            )
        out.append(
            Finding(f"{check}/{resource}", False, f"no node allocates {count} {resource} ({have})", fix)
        )
    return out or [Finding(check, True, f"{len(open_nodes)} node(s) labelled {selector}")]


def _check_device_classes(needs: RoleNeeds, snap: Snapshot) -> Finding:
    """The claim names two DeviceClasses; a missing one leaves the pods Pending (the drivers' charts
    install them: eks/aws-dranet the EFA one, the NVIDIA DRA driver's chart gpu.nvidia.com)."""
    missing = [c for c in (dra.GPU_CLASS, dra.EFA_CLASS) if c not in snap.device_classes]
    check = f"deviceclasses/{needs.role}"
    if missing:
        return Finding(
            check,
            False,
            f"the DeviceClass(es) {', '.join(missing)} the {needs.role} claim names do not exist "
            "(resource.k8s.io/v1 needs Kubernetes >= 1.34)",
            "install the NVIDIA GPU DRA driver and the EFA DRA driver (helm install aws-dranet "
            "eks/aws-dranet -n kube-system), whose charts create them",
        )
    return Finding(check, True, f"DeviceClasses {dra.GPU_CLASS} and {dra.EFA_CLASS} exist")


def _check_slices(needs: RoleNeeds, nodes: list[dict[str, Any]], snap: Snapshot) -> Finding:
    check = f"nodes/{needs.role}/dra"
    drivers = {
        dra.GPU_CLASS: "NVIDIA GPU DRA driver",
        EFA_DRIVER: "EFA DRA driver (helm install aws-dranet eks/aws-dranet)",
    }
    missing = [
        label
        for driver, label in drivers.items()
        if not any(_slice_devices(snap.slices, n["metadata"]["name"], driver) for n in nodes)
    ]
    if missing:
        return Finding(
            check,
            False,
            f"no ResourceSlices of the {' or '.join(missing)} on the role's nodes",
            f"install {' and '.join(missing)} on them, or set spec.{needs.role}.efaAttach: devicePlugin",
        )
    return Finding(check, True, "GPU and EFA ResourceSlices published on the role's nodes")


def check_plugins(needs: RoleNeeds, snap: Snapshot) -> list[Finding]:
    """Each device plugin the role's pods rely on runs as a DaemonSet that tolerates the nodes' taints."""
    if needs.dra_claim:
        wanted = [r for r in needs.devices if r not in dra.REPLACED_RESOURCES]
    else:
        wanted = list(needs.devices)
    nodes = _selected(snap.nodes, needs.node_selector)
    taints = {
        (t["key"], t.get("value", ""), t["effect"]): t
        for n in nodes
        for t in (n.get("spec") or {}).get("taints") or []
    }
    out = []
    for resource in sorted(wanted):
        label, marks, install = PLUGINS[resource]
        check = f"plugin/{resource}"
        found = [d for d in snap.daemonsets if _is_plugin(d, marks)]
        if not found:
            out.append(Finding(check, False, f"no {label} DaemonSet", install))
            continue
        for ds in found:
            tolerations = ds["spec"]["template"]["spec"].get("tolerations") or []
            untolerated = [
                t
                for t in taints.values()
                if t["effect"] in ("NoSchedule", "NoExecute") and not tolerates(tolerations, t)
            ]
            if untolerated:
                out.append(
                    Finding(
                        check,
                        False,
                        f"the {label} DaemonSet {_name(ds)} does not tolerate "
                        f"{', '.join(_taint(t) for t in untolerated)} of the {needs.role} nodes, so it never "
                        "runs there (the chart tolerates no taints by default)",
                        f"add tolerations: [{', '.join(_toleration(t) for t in untolerated)}] to its values",
                    )
                )
            else:
                out.append(Finding(check, True, f"{label} DaemonSet {_name(ds)} tolerates the nodes' taints"))
    return out


def _is_plugin(ds: dict[str, Any], marks: tuple[str, ...]) -> bool:
    images = [c.get("image", "") for c in ds["spec"]["template"]["spec"].get("containers", [])]
    return any(m in ds["metadata"]["name"] or any(m in i for i in images) for m in marks)


def check_scheduler(needs: RoleNeeds, snap: Snapshot) -> list[Finding]:
    """A role with its own schedulerName (the Neuron presets' my-scheduler) needs that scheduler running,
    and on Neuron the scheduler extension it calls; without them the pods stay Pending with no event."""
    name = needs.scheduler_name
    if not name or name == "default-scheduler":
        return []
    out = []
    running = [d for d in snap.deployments if d["metadata"]["name"] == name and _ready(d)]
    out.append(
        Finding(f"scheduler/{needs.role}", True, f"scheduler {name} runs ({_name(running[0])})")
        if running
        else Finding(
            f"scheduler/{needs.role}",
            False,
            f"no ready Deployment runs the scheduler {name} that the {needs.role} pods name",
            PLUGINS[NEURON][2]
            if NEURON in needs.devices
            else f"deploy {name}, or unset spec.{needs.role}.schedulerName",
        )
    )
    if NEURON in needs.devices:
        ext = [d for d in snap.deployments if SCHEDULER_EXTENSION in d["metadata"]["name"] and _ready(d)]
        out.append(
            Finding(
                f"scheduler-extension/{needs.role}", True, f"Neuron scheduler extension {_name(ext[0])} ready"
            )
            if ext
            else Finding(
                f"scheduler-extension/{needs.role}",
                False,
                "no ready Neuron scheduler extension Deployment: multi-device pods get no directly "
                "connected devices",
                PLUGINS[NEURON][2],
            )
        )
    return out


def check_crds(needs: Needs, snap: Snapshot) -> list[Finding]:
    out = []
    if needs.lws:
        out.append(
            Finding("lws", True, f"{LWS_CRD} is installed")
            if LWS_CRD in snap.crds
            else Finding(
                "lws",
                False,
                f"a role spans nodes (LeaderWorkerSet) but {LWS_CRD} is not installed",
                "install LeaderWorkerSet: kubectl apply --server-side -f "
                "https://github.com/kubernetes-sigs/lws/releases/latest/download/manifests.yaml",
            )
        )
    if needs.kueue:
        out.append(
            Finding("kueue", True, f"{KUEUE_CRD} is installed")
            if KUEUE_CRD in snap.crds
            else Finding(
                "kueue",
                False,
                f"spec.placement.gang is kueue but {KUEUE_CRD} is not installed",
                "install Kueue with its pod integration, or set spec.placement.gang: none",
            )
        )
    return out


def check_images(needs: Needs, snap: Snapshot) -> list[Finding]:
    """Image pulls that already failed on the CR's pods (container statuses and events)."""
    failures: dict[str, str] = {}
    pod_names = {p["metadata"]["name"] for p in snap.pods}
    for pod in snap.pods:
        statuses = (pod.get("status") or {}).get("initContainerStatuses", []) + (pod.get("status") or {}).get(
            "containerStatuses", []
        )
        for st in statuses or []:
            waiting = (st.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in PULL_FAILURES:
                failures.setdefault(
                    st.get("image", "?"), f"{waiting['reason']}: {waiting.get('message', '')}".strip()
                )
    for ev in snap.events:
        obj = ev.get("involvedObject") or {}
        message = ev.get("message") or ""
        if (
            obj.get("kind") == "Pod"
            and obj.get("name") in pod_names
            and "pull" in message.lower()
            and ev.get("type") == "Warning"
        ):
            failures.setdefault(_image_in(message), message)
    if not failures:
        return [Finding("images", True, f"no image pull failure seen on {len(pod_names)} pod(s)")]
    return [
        Finding(
            "images",
            False,
            f"{image}: {why}",
            "check that this image and tag exist in the registry and the nodes can reach it; a private "
            "registry needs spec.<role>.imagePullSecrets; set spec.image (or the chart's image.registry)",
        )
        for image, why in sorted(failures.items())
    ]


def _image_in(message: str) -> str:
    start = message.find('"')
    end = message.find('"', start + 1)
    return message[start + 1 : end] if 0 <= start < end else "image"


def check_efa_managers(needs: RoleNeeds, snap: Snapshot) -> list[Finding]:
    """EKS: the EFA DRA driver must not run on the same node as the EFA device plugin."""
    if EFA not in needs.devices and not needs.dra_claim:
        return []
    both = [
        n["metadata"]["name"]
        for n in _selected(snap.nodes, needs.node_selector)
        if _allocatable(n, EFA) and _slice_devices(snap.slices, n["metadata"]["name"], EFA_DRIVER)
    ]
    if not both:
        return []
    keep = "EFA DRA driver" if needs.dra_claim else "EFA device plugin"
    return [
        Finding(
            f"efa-managers/{needs.role}",
            False,
            f"both the EFA device plugin and the EFA DRA driver manage EFA on {', '.join(both)}; EKS "
            "says they must not run on the same node",
            f"keep only the {keep} on these nodes (the choice of spec.{needs.role}.efaAttach)",
        )
    ]


def run_checks(needs: Needs, snap: Snapshot) -> list[Finding]:
    out = check_control_plane(snap)
    for role in needs.roles:
        out += check_nodes(role, snap)
        out += check_efa_managers(role, snap)
        out += check_plugins(role, snap)
        out += check_scheduler(role, snap)
    out += check_crds(needs, snap)
    out += check_images(needs, snap)
    return _dedupe(out)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    """Both roles often need the same plugin: say each line once."""
    seen, out = set(), []
    for f in findings:
        key = (f.ok, f.detail)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
