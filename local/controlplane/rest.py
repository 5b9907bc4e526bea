"""Startup-path API calls: a few JSON requests over mutual TLS with the standard library.

The plane's own readiness checks and node creation use this instead of the `kubernetes` package, whose
import costs seconds on a loaded machine (hundreds of generated modules), so a warm start stays fast.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvferry.local.controlplane.certs import CertPair

REQUEST_TIMEOUT_S = 10.0
MERGE_PATCH = "application/merge-patch+json"


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:300]}")
        self.status = status


class Rest:
    """JSON over HTTPS to one API server, as one client-cert identity (proxies never apply: loopback)."""

    def __init__(self, server: str, ca: Path, client: CertPair) -> None:
        self.server = server
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.load_cert_chain(str(client.cert), str(client.key))
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
        )

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with self._opener.open(req, timeout=REQUEST_TIMEOUT_S) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, method, path, e.read().decode(errors="replace")) from None
        ctype = resp.headers.get("Content-Type", "")
        return json.loads(raw) if ctype.startswith("application/json") else raw.decode().strip()

    def get(self, path: str) -> Any:
        return self.call("GET", path)

    def exists(self, path: str) -> bool:
        try:
            self.get(path)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise


def probe(url: str, *, insecure: bool = False) -> str:
    """GET a health endpoint (etcd over http, component /healthz over self-signed https)."""
    ctx = None
    if url.startswith("https://") and insecure:  # controller-manager/scheduler serve a self-signed cert
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx)
    )
    with opener.open(url, timeout=REQUEST_TIMEOUT_S) as resp:
        return resp.read().decode().strip()
