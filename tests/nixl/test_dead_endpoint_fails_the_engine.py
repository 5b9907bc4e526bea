"""If the endpoint thread ever stops serving (a bug in a round, outside any one request's guard), the
engine must not go on serving requests whose transfers nobody moves: the worker raises at vLLM's next
step, vLLM's engine core dies with it, and vLLM's /health answers 503 (EngineDeadError), so
Kubernetes restarts the pod. Real endpoint and NIXL agent, in this process."""

from __future__ import annotations

import pytest
from kvferry.connector.config import KvferryConfig
from kvferry.connector.endpoint import Endpoint
from kvferry.tools.hostkv import CacheShape, host_kv

from tests.waiting import wait_until

pytestmark = pytest.mark.nixl


def test_a_dead_endpoint_thread_fails_the_engine_loudly(monkeypatch):
    pytest.importorskip("vllm", reason="the worker glue runs inside vLLM")
    from kvferry.connector.worker import KvferryWorker

    kv = host_kv(CacheShape(), 0)
    cfg = KvferryConfig.from_extra({"backends": ["UCX"], "side_channel_port": 0})
    ep = Endpoint(cfg, role="consumer", engine_id="decode-0", tp_rank=0, tp_size=1, layout=kv.layout).start()
    try:

        def broken(now: float) -> list:
            raise RuntimeError("a bug in the round")

        monkeypatch.setattr(ep.consumer, "tick", broken)
        ep.kick()
        assert wait_until(lambda: ep.dead, "the endpoint thread to die", 30, 0.05) == (
            "RuntimeError: a bug in the round"
        )
        # `dead` is set just before the thread returns: wait (bounded) for the exit itself, not a race.
        ep._thread.join(10)
        assert not ep._thread.is_alive()
        worker = KvferryWorker.__new__(KvferryWorker)  # only the step hook is exercised
        worker.endpoint = ep
        with pytest.raises(RuntimeError, match="kvferry endpoint thread died .*a bug in the round"):
            worker.get_transfer_results()
    finally:
        ep.close()
