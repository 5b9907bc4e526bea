"""KV feed step: follow each engine's KV-cache events (ZMQ) into the router's prefix index.

One task per engine that names its event endpoints (`Endpoint.kv_events`, and `kv_events_replay` for
vLLM's replay buffer): a SUB socket on the live stream, and, right after connecting, after a gap in the
sequence numbers, and after a restart (the numbers went back), a DEALER request to the replay endpoint
for every buffered batch from the first one missing. The pure part (router/kvevents.py) turns batches
into the router's block keys; this module only moves frames. Every wait is bounded: a replay that does
not end within REPLAY_TIMEOUT_S is abandoned (the index then under-counts, which costs reuse, never
correctness) and the live stream goes on. The feed follows the pool: engines that leave it are
unsubscribed and their keys forgotten with the rest of the index.

The publisher is a peer, so what it can cost the router is bounded: frames past MAX_FRAME_BYTES are
refused by ZMQ before they are buffered (the connection is reset; the next frame shows a gap), at most
RCVHWM frames wait per socket, and a batch is applied in slices (kvevents.SLICE_UNITS blocks) with the
event loop served between them, so a batch of any size delays a client request by one slice at most.
Frames that cannot be read, and events past a size bound, are dropped and counted
(`kvferry_router_kv_event_dropped_total`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import zmq
import zmq.asyncio
from kvferry.router import kvevents
from kvferry.router.config import Endpoint
from kvferry.router.metrics import RouterMetrics
from kvferry.router.prefix import PrefixIndex

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 5.0  # per reply frame; vLLM answers a replay from memory
# A batch is one engine step's events (KiBs; 1 MiB is ~9k blocks, over 140k tokens in one step); a
# larger frame is dropped by ZMQ before it is buffered, so a broken or hostile publisher cannot make
# the router hold arbitrary amounts of memory (at most RCVHWM frames per socket, two sockets per
# engine) nor hold the loop long: splitting a frame into its events walks all of it (~15 ms per MiB).
MAX_FRAME_BYTES = 1 << 20
RCVHWM = 16  # frames queued per socket; the live stream backs up into the engine's own send queue
END_SEQ = -1  # vLLM's end-of-replay marker
RECONNECT_S = 0.5
WARN_EVERY_S = 60.0  # a publisher sending garbage is logged once a minute (and counted every time)


class KvEventFeed:
    """Subscriptions to the pool's engines' KV-cache events, applied to `index`."""

    def __init__(self, index: PrefixIndex, block_tokens: int, metrics: RouterMetrics) -> None:
        self.index, self.block_tokens, self.metrics = index, block_tokens, metrics
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[Endpoint, asyncio.Task[None]]] = {}
        self._warned: dict[str, float] = {}

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
        """The engine's live stream, forever (until cancelled); a broken frame is logged and skipped,
        a dropped connection followed by a new one."""
        state = kvevents.EngineBlocks(self.block_tokens, self.index.max_blocks)
        reason, loop = "connect", asyncio.get_running_loop()
        try:
            while True:
                began = loop.time()
                await self._subscribed(ep, state, reason)
                reason = "reconnect"
                # At once after a connection that lasted (frames are lost while no socket listens); a
                # peer that drops every connection costs one new socket per RECONNECT_S.
                await asyncio.sleep(max(0.0, began + RECONNECT_S - loop.time()))
        except asyncio.CancelledError:
            raise
        except Exception:  # never a quietly dead task: say so; the next pool sync starts it again
            log.exception("kv events of %s stopped", ep.engine_id)
            self._tasks.pop(ep.url, None)
            self.metrics.kv_event_engines.labels(ep.role).dec()

    async def _subscribed(self, ep: Endpoint, state: kvevents.EngineBlocks, reason: str) -> None:
        """One SUB socket's life: replay what was missed, then the live stream until the connection
        drops. libzmq reconnects after a peer restart but not after a protocol error (a frame past
        MAXMSGSIZE closes the connection for good), so every drop gets a new socket."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(ep.kv_events)
        try:
            await self._replay(ep, state, reason)
            while True:
                ready = dict(await poller.poll())
                if sub in ready:
                    frames = await sub.recv_multipart()
                    try:
                        await self._live(ep, state, frames)
                    except kvevents.EventError as exc:
                        self._drop(ep, "malformed", exc)
                elif monitor in ready:
                    await monitor.recv_multipart()
                    return
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
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
        await self._apply(ep, state, seq, frames[2], live=True)

    async def _replay(self, ep: Endpoint, state: kvevents.EngineBlocks, reason: str) -> None:
        """Every buffered batch from state.next_seq on, until vLLM's end marker or a bounded wait."""
        self.metrics.kv_event_resyncs.labels(ep.role, reason).inc()
        if not ep.kv_events_replay:
            return  # nothing to re-read: what was missed stays missed (the index under-counts)
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        req.setsockopt(zmq.RCVHWM, RCVHWM)
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
                try:
                    if len(frames) != 4:
                        raise kvevents.EventError(f"replay answer of {len(frames)} frames, expected 4")
                    seq = kvevents.seq_of(frames[2])
                except kvevents.EventError as exc:
                    self._drop(ep, "malformed", exc)  # the replay cannot be followed: the live stream goes on
                    return
                if seq == END_SEQ:
                    return
                await self._apply(ep, state, seq, frames[3], live=False)
        finally:
            req.close(linger=0)

    async def _apply(
        self, ep: Endpoint, state: kvevents.EngineBlocks, seq: int, payload: bytes, live: bool
    ) -> None:
        """Apply one batch to the index, a slice at a time, serving the event loop between slices."""
        try:
            batch = kvevents.decode(payload)
        except kvevents.EventError as exc:
            self._drop(ep, "malformed", exc)
            if state.lost(seq, live):  # what it stored or evicted is unknown: forget the engine's blocks
                self.index.cleared(ep.url)
            return
        parts = state.slices(seq, batch, live=live)
        if parts is None:
            return
        for change in parts:
            self._index(ep, change)
            await asyncio.sleep(0)  # one slice at a time: client requests are served in between

    def _index(self, ep: Endpoint, change: kvevents.Change) -> None:
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
        for reason, n in (("refused", change.refused), ("unknown", change.unknown)):
            if n:
                self.metrics.kv_event_dropped.labels(ep.role, reason).inc(n)

    def _drop(self, ep: Endpoint, reason: str, exc: Exception) -> None:
        """Count a frame that could not be read; log it at most once a minute per engine."""
        self.metrics.kv_event_dropped.labels(ep.role, reason).inc()
        now = time.monotonic()
        if now - self._warned.get(ep.url, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[ep.url] = now
            log.warning("kv events of %s: %s (dropped; counted in kv_event_dropped)", ep.engine_id, exc)
