"""KV feed step: follow each engine's KV-cache events (ZMQ) into the router's prefix index.

One task per engine that names its event endpoints (`Endpoint.kv_events`, and `kv_events_replay` for
vLLM's replay buffer): a SUB socket on the live stream, and, right after connecting, after a gap in the
sequence numbers, and after a restart (the numbers went back), a DEALER request to the replay endpoint
for every buffered batch from the first one missing. The pure part (router/kvevents.py) turns batches
into the router's block keys; this module only moves frames. Every wait is bounded: a replay that does
not end within REPLAY_TIMEOUT_S is abandoned (the index then under-counts, which costs reuse, never
correctness) and the live stream goes on. The feed follows the pool: engines that leave it are
unsubscribed and their keys forgotten with the rest of the index.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import zmq
import zmq.asyncio
from kvferry.router import kvevents
from kvferry.router.config import Endpoint
from kvferry.router.metrics import RouterMetrics
from kvferry.router.prefix import PrefixIndex

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 5.0  # per reply frame; vLLM answers a replay from memory
# A batch is one engine step's events (KiBs); a larger frame is dropped by ZMQ before it is buffered,
# so a broken or hostile publisher cannot make the router hold arbitrary amounts of memory.
MAX_FRAME_BYTES = 32 << 20
END_SEQ = -1  # vLLM's end-of-replay marker


class KvEventFeed:
    """Subscriptions to the pool's engines' KV-cache events, applied to `index`."""

    def __init__(self, index: PrefixIndex, block_tokens: int, metrics: RouterMetrics) -> None:
        self.index, self.block_tokens, self.metrics = index, block_tokens, metrics
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[Endpoint, asyncio.Task[None]]] = {}

    def sync(self, engines: Iterable[Endpoint]) -> None:
        """Follow the engines that publish events; stop following the ones that left (or changed)."""
        want = {e.url: e for e in engines if e.kv_events}
        for url, (ep, task) in list(self._tasks.items()):
            if want.get(url) != ep:
                task.cancel()
                del self._tasks[url]
                self.metrics.kv_event_engines.labels(ep.role).dec()
        for url, ep in want.items():
            if url not in self._tasks:
                self._tasks[url] = (
                    ep,
                    asyncio.create_task(self._follow(ep), name=f"kv-events {ep.engine_id}"),
                )
                self.metrics.kv_event_engines.labels(ep.role).inc()

    async def stop(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._ctx.destroy(linger=0)

    async def _follow(self, ep: Endpoint) -> None:
        """The engine's live stream, forever (until cancelled); a broken frame is logged and skipped."""
        state = kvevents.EngineBlocks(self.block_tokens, self.index.max_blocks)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.connect(ep.kv_events)
        try:
            await self._replay(ep, state, "connect")
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self._live(ep, state, frames)
                except kvevents.EventError as exc:
                    log.warning("kv events of %s: %s", ep.engine_id, exc)
        except asyncio.CancelledError:
            raise
        except Exception:  # never a quietly dead task: say so; the next pool sync starts it again
            log.exception("kv events of %s stopped", ep.engine_id)
            self._tasks.pop(ep.url, None)
            self.metrics.kv_event_engines.labels(ep.role).dec()
        finally:
            sub.close(linger=0)

    async def _live(self, ep: Endpoint, state: kvevents.EngineBlocks, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise kvevents.EventError(f"{len(frames)} frames, expected topic, sequence, payload")
        seq = kvevents.seq_of(frames[1])
        if state.restarted(seq):
            state.reset()
            self.index.cleared(ep.url)
            await self._replay(ep, state, "restart")
        elif state.gap(seq):
            await self._replay(ep, state, "gap")
        self._apply(ep, state, seq, kvevents.decode(frames[2]), live=True)

    async def _replay(self, ep: Endpoint, state: kvevents.EngineBlocks, reason: str) -> None:
        """Every buffered batch from state.next_seq on, until vLLM's end marker or a bounded wait."""
        if not ep.kv_events_replay:
            return
        self.metrics.kv_event_resyncs.labels(ep.role, reason).inc()
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        req.connect(ep.kv_events_replay)
        try:
            await req.send_multipart([b"", state.next_seq.to_bytes(kvevents.SEQ_BYTES, "big")])
            while True:
                if not await req.poll(REPLAY_TIMEOUT_S * 1000):
                    log.warning(
                        "kv events of %s: replay gave no end within %ss", ep.engine_id, REPLAY_TIMEOUT_S
                    )
                    return
                frames = await req.recv_multipart()  # b"", topic, seq, payload
                if len(frames) != 4:
                    raise kvevents.EventError(f"replay answer of {len(frames)} frames, expected 4")
                seq = kvevents.seq_of(frames[2])
                if seq == END_SEQ:
                    return
                self._apply(ep, state, seq, kvevents.decode(frames[3]), live=False)
        finally:
            req.close(linger=0)

    def _apply(
        self, ep: Endpoint, state: kvevents.EngineBlocks, seq: int, batch: kvevents.Batch, live: bool
    ) -> None:
        change = state.apply(seq, batch, live=live)
        if change is None:
            return
        if change.cleared:
            self.index.cleared(ep.url)
        self.index.removed(ep.url, change.removed)
        self.index.stored(ep.url, change.stored)
        for what, n in (
            ("stored", len(change.stored)),
            ("removed", len(change.removed)),
            ("skipped", change.skipped),
        ):
            if n:
                self.metrics.kv_event_blocks.labels(ep.role, what).inc(n)
