"""A vLLM-CPU server started by kvferry's launch step does not busy-wait after a request.

vLLM's engine<->worker shared-memory queue spins on sched_yield for 1 s after every message (two
processes per server at ~100 % of a core each); on two cores that starved everything else and
doubled P/D TTFT. The launch step makes it sleep instead (connector/plugins/shm_wait.py). The
connector's own cost with nothing to transfer is measured by bench/connector_idle_cost.py."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
WINDOW_S = 0.8  # inside vLLM's 1 s busy-wait window after the last message


def test_server_right_after_a_request_uses_little_cpu(tiny_model: Path, tmp_path: Path) -> None:
    spec = ServerSpec(model=tiny_model, port=free_port(), cores="0-1")
    with VllmProcess(spec, tmp_path / "single.log") as server:
        body = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 4, "temperature": 0}
        for _ in range(3):
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
            before = server.thread_cpu_seconds()
            time.sleep(WINDOW_S)
            grown = {k: round(v - before.get(k, 0.0), 2) for k, v in server.thread_cpu_seconds().items()}
            used = sum(grown.values())
            # Spinning: engine core + worker ~2 cores x 0.8 s. Sleeping: a few percent of one core.
            busy = {k: v for k, v in grown.items() if v}
            assert used < 0.3 * WINDOW_S, f"server used {used:.2f} CPU-s in {WINDOW_S} s, by thread: {busy}"
