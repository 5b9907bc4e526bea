"""Client step: kubeconfig files for the plane's identities and API clients built from them.

Kubeconfigs embed the certificates (no paths), so a copy stays valid wherever it is read. `sa_client`
acts as a ServiceAccount with a real token from the TokenRequest API, signed by the plane's key: RBAC is
checked exactly as it is for a pod.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml
from kvferry.local.controlplane.certs import CertPair

CLUSTER = "kvferry-local"
SA_TOKEN_SECONDS = 3600


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def render(
    server: str, ca: Path, user: str, client: CertPair | None = None, token: str | None = None
) -> dict:
    creds: dict[str, Any] = {}
    if client is not None:
        creds = {"client-certificate-data": _b64(client.cert), "client-key-data": _b64(client.key)}
    if token is not None:
        creds = {"token": token}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": CLUSTER, "cluster": {"server": server, "certificate-authority-data": _b64(ca)}}
        ],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": f"{user}@{CLUSTER}", "context": {"cluster": CLUSTER, "user": user}}],
        "current-context": f"{user}@{CLUSTER}",
    }


def write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def read_server_and_ca(path: Path) -> tuple[str, bytes]:
    """The (server URL, CA PEM) of a kubeconfig's current context; raises ValueError naming what is wrong."""
    cfg = yaml.safe_load(Path(path).read_text()) or {}
    ctx_name = cfg.get("current-context")
    ctx = next((c["context"] for c in cfg.get("contexts", []) if c.get("name") == ctx_name), None)
    if ctx is None:
        raise ValueError(f"kubeconfig {path}: current-context {ctx_name!r} not found")
    cluster = next(
        (c["cluster"] for c in cfg.get("clusters", []) if c.get("name") == ctx.get("cluster")), None
    )
    if cluster is None or "certificate-authority-data" not in cluster:
        raise ValueError(f"kubeconfig {path}: cluster {ctx.get('cluster')!r} has no embedded CA")
    return cluster["server"], base64.b64decode(cluster["certificate-authority-data"])


def api_client(path: Path):
    """A kubernetes.client.ApiClient from a kubeconfig file (imported lazily: kopf-free callers need it)."""
    from kubernetes import config

    return config.new_client_from_config(config_file=str(path))


def token_client(server: str, ca: Path, token: str):
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = server
    cfg.ssl_ca_cert = str(ca)
    cfg.api_key = {"authorization": token}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(cfg)


def service_account_token(admin, namespace: str, name: str, *, create: bool = True) -> str:
    """A TokenRequest token for ServiceAccount `namespace/name`, creating the account if asked."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(admin)
    try:
        core.read_namespaced_service_account(name, namespace)
    except ApiException as e:
        if e.status != 404:
            raise
        if not create:
            raise ValueError(f"ServiceAccount {namespace}/{name} does not exist") from e
        body = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))
        core.create_namespaced_service_account(namespace, body)
    req = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=SA_TOKEN_SECONDS)
    )
    return core.create_namespaced_service_account_token(name, namespace, req).status.token
