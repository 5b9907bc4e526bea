"""router/kvfeed.py against vLLM's own ZMQ publisher (vllm.distributed.kv_events.ZmqEventPublisher, the
class an engine started with --kv-events-config runs), in-process on ipc sockets: batches published
before the router connected arrive through the replay buffer, live ones follow, evictions leave the
index, and a publisher that starts again (its numbering back at 0) clears what the router knew."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from kvferry.router.config import Endpoint
from kvferry.router.kvfeed import KvEventFeed
from kvferry.router.metrics import RouterMetrics
from kvferry.router.prefix import PrefixIndex, prompt_keys
from vllm.distributed import kv_events  # the publisher an engine runs

BLOCK = 16
URL = "http://decode-0:8000"


def _stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> object:
    return kv_events.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
        lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip


def _publisher(tmp_path: Path) -> object:
    return kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay"
    )


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_replayed_live_removed_and_restarted(tmp_path: Path) -> None:
    tokens = list(range(1000, 1000 + 3 * BLOCK))
    keys = list(prompt_keys(tokens, BLOCK, 4.0).keys)
    index, metrics = PrefixIndex(1000), RouterMetrics()
    ep = Endpoint("decode", URL, "decode-0", "10.0.0.2", 5600,
                  kv_events=f"ipc://{tmp_path}/pub", kv_events_replay=f"ipc://{tmp_path}/replay")  # fmt: skip

    async def scenario() -> None:
        pub = _publisher(tmp_path)
        try:
            # Before the router listens: only the replay buffer can tell it.
            pub.publish(kv_events.KVEventBatch(ts=1.0, events=[_stored([b"h0"], None, tokens[:BLOCK])]))
            await asyncio.sleep(0.3)
            feed = KvEventFeed(index, BLOCK, metrics)
            feed.sync([ep])
            await _until(lambda: index.match(URL, keys) == 1, "the replayed first block")
            # Live: the next two blocks, chained to the first; then the last one evicted.
            pub.publish(
                kv_events.KVEventBatch(ts=2.0, events=[_stored([b"h1", b"h2"], b"h0", tokens[BLOCK:])])
            )
            await _until(lambda: index.match(URL, keys) == 3, "the live blocks")
            pub.publish(
                kv_events.KVEventBatch(
                    ts=3.0, events=[kv_events.BlockRemoved(block_hashes=[b"h2"], medium="GPU")]
                )
            )
            await _until(lambda: index.match(URL, keys) == 2, "the eviction")
        finally:
            pub.shutdown()
        # The engine starts again: a new publisher, numbering from 0, an empty cache.
        pub = _publisher(tmp_path)
        try:
            await asyncio.sleep(0.5)  # the SUB socket reconnects to the new publisher
            other = list(range(5000, 5000 + BLOCK))
            pub.publish(kv_events.KVEventBatch(ts=4.0, events=[_stored([b"n0"], None, other)]))
            await _until(
                lambda: index.match(URL, prompt_keys(other, BLOCK, 4.0).keys) == 1, "the new engine's block"
            )
            assert index.match(URL, keys) == 0  # what the old engine held was forgotten with it
        finally:
            pub.shutdown()
            await feed.stop()

    asyncio.run(scenario())
    text = metrics.render().decode()
    for line in (
        'kvferry_router_kv_event_resyncs_total{reason="connect",role="decode"} 1.0',
        'kvferry_router_kv_event_resyncs_total{reason="restart",role="decode"} 1.0',
        'kvferry_router_kv_event_blocks_total{change="removed",role="decode"} 1.0',
    ):
        assert line in text, text
