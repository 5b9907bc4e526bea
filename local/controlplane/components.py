"""Command lines of the control-plane components: pure functions from ports and paths to argv.

Everything binds 127.0.0.1 on ports chosen at start. Choices that are not defaults, and why:
- apiserver `--advertise-address=127.0.0.1 --endpoint-reconciler-type=none`: with no default route the
  server cannot pick an address, and the lease reconciler rejects loopback endpoints.
- controller-manager keeps node-lifecycle-controller on: it lifts the not-ready taint that the
  TaintNodesByCondition admission plugin puts on every new Node, once kwok reports the Node Ready.
- kwok gets the v0.8.0 stage files as --config (that release has no built-in stages) and manages only
  Nodes annotated `kwok.x-k8s.io/node=fake`, so another agent can own an unannotated node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvferry.local.controlplane import build
from kvferry.local.controlplane.certs import PlaneCerts
from kvferry.local.controlplane.nodes import KWOK_ANNOTATION, KWOK_VALUE

SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
FAKE_NODE_IP = "10.250.0.1"  # never dialled: logs/exec on fake pods are out of scope
ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int

    @classmethod
    def from_list(cls, ports: list[int]) -> Ports:
        return cls(*ports)


def etcd(ports: Ports, data_dir: Path) -> list[str]:
    client, peer = f"http://127.0.0.1:{ports.etcd_client}", f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        str(build.binary("etcd")),
        "--name=kvferry",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kvferry={peer}",
        "--unsafe-no-fsync",  # throwaway data: skip fsync, a large win on shared disks
        "--log-level=warn",
    ]


def apiserver(ports: Ports, certs: PlaneCerts, cert_dir: Path) -> list[str]:
    return [
        str(build.binary("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.apiserver}",
        "--advertise-address=127.0.0.1",
        "--endpoint-reconciler-type=none",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={certs.serving.cert}",
        f"--tls-private-key-file={certs.serving.key}",
        f"--client-ca-file={certs.ca.cert}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer={ISSUER}",
        f"--service-account-key-file={certs.sa_pub}",
        f"--service-account-signing-key-file={certs.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true",
        "--profiling=false",
    ]


def _delegated_auth(kubeconfig: Path, port: int, cert_dir: Path) -> list[str]:
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={cert_dir}",
        "--profiling=false",
    ]


def controller_manager(ports: Ports, certs: PlaneCerts, kubeconfig: Path, cert_dir: Path) -> list[str]:
    return [
        str(build.binary("kube-controller-manager")),
        *_delegated_auth(kubeconfig, ports.controller_manager, cert_dir),
        f"--service-account-private-key-file={certs.sa_key}",
        f"--root-ca-file={certs.ca.cert}",  # fills each namespace's kube-root-ca.crt ConfigMap
        "--use-service-account-credentials=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--cluster-name=kvferry",
    ]


def scheduler(ports: Ports, kubeconfig: Path, cert_dir: Path) -> list[str]:
    return [str(build.binary("kube-scheduler")), *_delegated_auth(kubeconfig, ports.scheduler, cert_dir)]


def kwok(kubeconfig: Path) -> list[str]:
    return [
        str(build.binary("kwok")),
        f"--kubeconfig={kubeconfig}",
        f"--config={build.kwok_stages_path()}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_VALUE}",
        "--manage-nodes-with-label-selector=",
        "--manage-single-node=",
        f"--cidr={POD_CIDR}",
        f"--node-ip={FAKE_NODE_IP}",
        "--node-lease-duration-seconds=40",
    ]
