"""API access for the node agent: plain JSON over HTTPS to the kube-apiserver, with bounded timeouts.

The agent works on raw objects (dicts) the way a kubelet reads them, so it uses httpx with the
credentials that `kubernetes.config` resolves from a kubeconfig, rather than the generated model
classes. Every call has a timeout; watches end after `timeout_seconds` and are resumed by the caller.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

REQUEST_TIMEOUT_S = 15.0


class KubeError(RuntimeError):
    """An API call failed; `status` is the HTTP status code (0 when the server was not reached)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def _tls_context(cfg: k8s_client.Configuration) -> ssl.SSLContext | bool:
    """The server CA and, for certificate users, the client key pair, as one SSL context."""
    if not cfg.verify_ssl and not cfg.cert_file:
        return False
    ctx = (
        ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.ssl_ca_cert
        else ssl.create_default_context()
    )
    if not cfg.verify_ssl:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return ctx


class Kube:
    """A small JSON client for one apiserver, built from a kubeconfig file."""

    def __init__(self, kubeconfig: str, context: str | None = None) -> None:
        cfg = k8s_client.Configuration()
        k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
        self.server = cfg.host.rstrip("/")
        self.ca_file = cfg.ssl_ca_cert
        headers = {"Accept": "application/json"}
        token = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
        if token:
            headers["Authorization"] = token if token.startswith("Bearer ") else f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.server, headers=headers, verify=_tls_context(cfg), timeout=REQUEST_TIMEOUT_S
        )

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One call; raises KubeError naming the method, path and the server's message."""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        try:
            resp = self._http.request(method, path, content=data, params=params, headers=headers)
        except httpx.HTTPError as exc:
            raise KubeError(f"{method} {path}: {exc!r}") from exc
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            raise KubeError(f"{method} {path}: HTTP {resp.status_code}: {message}", resp.status_code)
        return resp.json() if resp.content else {}

    def get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("GET", path, params=params)

    def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def watch(self, path: str, params: dict[str, Any], timeout_s: int) -> Iterator[dict[str, Any]]:
        """Yield watch events until the server closes the stream (after `timeout_s`)."""
        query = dict(params, watch="true", timeoutSeconds=str(timeout_s), allowWatchBookmarks="true")
        # The read timeout bounds silence on the stream: the server ends it at timeout_s anyway.
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, read=timeout_s + REQUEST_TIMEOUT_S)
        try:
            with self._http.stream("GET", path, params=query, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise KubeError(f"WATCH {path}: HTTP {resp.status_code}: {resp.text}", resp.status_code)
                for line in resp.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.HTTPError as exc:
            raise KubeError(f"WATCH {path}: {exc!r}") from exc
