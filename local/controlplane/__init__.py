"""Local Kubernetes control plane on loopback: real etcd, kube-apiserver, controller-manager, scheduler, kwok.

Public API (what tests, the operator's cluster tests and `kvferry demo` use):

- `build.ensure_built()`: build the pinned binaries once into $KVFERRY_BIN (cached, idempotent).
- `ControlPlane`: `start(workdir)`, `stop()`, `kubeconfig`, `admin_client()`, `sa_client(ns, name)`,
  `apply_nodes(...)`, `env()`.
- `nodes`: fake node shapes (p5en.48xlarge, trn2.48xlarge, cpu) as data.
"""

from kvferry.local.controlplane.plane import ControlPlane, ControlPlaneError

__all__ = ["ControlPlane", "ControlPlaneError"]
