"""The metrics scrape fetches only the operator's own URL template, only for pods our StatefulSets own,
with bare placeholders and a response size cap: nothing a CR author writes steers or sizes a fetch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kvferry.operator.runtime.config import OperatorConfig, check_template
from kvferry.operator.status.scrape import http_fetcher, metrics_urls

TEMPLATE = "http://{pod_ip}:{port}/metrics"


def _pod(name: str, role: str, owner: str | None, ip: str = "10.0.0.5") -> dict:
    refs = [{"kind": "StatefulSet", "name": owner, "controller": True}] if owner else []
    return {
        "metadata": {
            "name": name,
            "namespace": "team",
            "labels": {"kvferry.io/name": "svc", "kvferry.io/role": role},
            "ownerReferences": refs,
        },
        "status": {"phase": "Running", "podIP": ip},
    }


@pytest.mark.parametrize(
    "template",
    [
        "http://x/{pod:>700000000}",  # a format spec allocates at will
        "http://x/{pod.__class__}",  # attribute lookups
        "http://x/{pod[0]}",
        "http://x/{pod!r}",
        "http://x/{secret}",  # unknown placeholder
        "http://x/{}",
        "file:///etc/passwd",
        "http://x/{pod",
    ],
)
def test_templates_with_more_than_bare_placeholders_are_refused(template: str) -> None:
    with pytest.raises(ValueError):
        check_template(template)
    with pytest.raises(ValueError):
        OperatorConfig(metrics_url=template)


def test_the_default_template_and_all_placeholders_are_accepted() -> None:
    check_template(OperatorConfig().metrics_url)
    check_template("https://m.example/{namespace}/{pod}/{pod_ip}/{port}/{role}")


def test_only_pods_of_the_crs_own_statefulsets_are_read() -> None:
    pods = [
        _pod("svc-prefill-0", "prefill", "svc-prefill"),
        _pod("svc-decode-0", "decode", "svc-decode"),
        _pod("fake-0", "prefill", None, ip="169.254.169.254"),  # labelled by hand
        _pod("other-0", "decode", "other-decode", ip="10.9.9.9"),  # another StatefulSet's
    ]
    urls = metrics_urls(pods, TEMPLATE, "svc")
    assert urls == {"prefill": ["http://10.0.0.5:8000/metrics"], "decode": ["http://10.0.0.5:8000/metrics"]}


class _Server:
    def __init__(self, body: bytes, status: int = 200, location: str = "") -> None:
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.hits += 1
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve() -> Iterator:
    made: list[_Server] = []

    def make(*args, **kw) -> _Server:
        made.append(_Server(*args, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_response_over_the_cap_is_dropped(serve) -> None:
    big = serve(b"x" * 5000)
    assert http_fetcher(2.0, max_bytes=4096)(big.url) is None
    assert http_fetcher(2.0, max_bytes=8192)(big.url) == "x" * 5000


def test_redirects_are_not_followed(serve) -> None:
    canary = serve(b"secret")
    hop = serve(b"", status=302, location=canary.url)
    assert http_fetcher(2.0)(hop.url) is None
    assert canary.hits == 0
