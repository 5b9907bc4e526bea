"""Version pins for the local control plane: the one place to change what gets built.

Pairings follow the envtest matrix and kubeadm's SupportedEtcdVersion (k8s 1.35 <-> etcd 3.6.x).
Every pin must be served by the Go module proxy; `kvferry cluster build` checks with `go mod download`.
"""

from __future__ import annotations

KUBERNETES = "1.35.4"  # kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
ETCD = "3.6.8"  # go.etcd.io/etcd/server/v3 (its module root is `package main`)
KWOK = "0.8.0"  # sigs.k8s.io/kwok: stands in for kubelets on fake nodes
HELM = "3.22.0"  # helm.sh/helm/v3
LWS = "0.8.0"  # sigs.k8s.io/lws: LeaderWorkerSet CRD, controller and webhooks (multi-node roles)
KUEUE = "0.17.0"  # sigs.k8s.io/kueue: gang admission of P and D as one pod group (built on demand)

GO_MIN = (1, 26)  # kwok v0.8.0 and helm v3.22 need go >= 1.26


def kube_minor() -> str:
    return KUBERNETES.split(".")[1]


def staging_version() -> str:
    """k8s.io/<staging> modules are tagged v0.<minor>.<patch> for Kubernetes 1.<minor>.<patch>."""
    _, minor, patch = KUBERNETES.split(".")
    return f"v0.{minor}.{patch}"
