"""Engine metrics for the operator's transfer-status timer without engines: Prometheus text the
connector would export, served per pod by a real HTTP server on 127.0.0.1 (the operator's own
--metrics-url template points at it). A plugin (tests/conftest.py): tests request `fake_metrics`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kvferry.contracts import metrics as m


def prometheus(transfers: int, failures: int, backend: str = "LIBFABRIC") -> str:
    buckets = [(0.01, transfers // 10), (0.05, transfers * 9 // 10), (0.1, transfers)]
    hist = m.MATCH_TO_DONE_SECONDS
    lines = [
        f"# TYPE {m.TRANSFERS} counter",
        f'{m.total(m.TRANSFERS)}{{{m.BACKEND}="{backend}"}} {transfers}',
        f"# TYPE {m.TRANSFER_FAILURES} counter",
        f'{m.total(m.TRANSFER_FAILURES)}{{{m.REASON}="deadline"}} {failures}',
        f"# TYPE {hist} histogram",
    ]
    lines += [f'{hist}_bucket{{le="{le}"}} {n}' for le, n in buckets]
    lines += [f'{hist}_bucket{{le="+Inf"}} {transfers}', f"{hist}_count {transfers}", f"{hist}_sum 3.0"]
    return "\n".join(lines) + "\n"


class FakeMetrics:
    """Serves /<namespace>/<pod> -> the text set for that pod (404 otherwise); `hits` lists the paths."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.hits.append(self.path)
                text = outer.texts.get(self.path.rsplit("/", 1)[-1])
                self.send_response(200 if text is not None else 404)
                self.end_headers()
                self.wfile.write((text or "").encode())

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}" + "/{namespace}/{pod}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_metrics() -> Iterator[FakeMetrics]:
    server = FakeMetrics()
    yield server
    server.close()
