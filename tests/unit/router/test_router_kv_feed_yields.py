"""router/kvfeed.py on the real ZMQ path inside the real router app: a publisher sends one batch of
32,768 blocks (a frame the old feed applied in one go, holding the event loop for ~0.2 s here and ~9 s
for a 32 MiB frame), and an HTTP request that arrives while the batch is being applied is answered
between its slices, not after it. No clock is read: the order of what the loop did is the evidence."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web
from kvferry.router.app import STATE, build_app
from kvferry.router.config import parse_config
from kvferry.router.prefix import prompt_keys

BLOCK = 16
HOSTILE_BLOCKS = 1 << 15
PER_EVENT = 1 << 12  # kvevents.MAX_EVENT_BLOCKS
SLICE = 1024  # kvevents.SLICE_UNITS (literals: this test must also run, and fail, on the unsliced feed)
_enc = msgspec.msgpack.Encoder()


def frame(seq: int, events: list[dict[str, Any]]) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big", signed=True), _enc.encode([1.0, events, 0])]


def stored(hashes: list[Any], parent: Any, tokens: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU"}  # fmt: skip


def hostile_events() -> list[dict[str, Any]]:
    """32,768 chained blocks (~0.7 MB, under the 1 MiB frame cap), in events of MAX_EVENT_BLOCKS,
    and one event with a hash far past MAX_HASH_BYTES (100 kB)."""
    per, events = PER_EVENT, []
    for start in range(0, HOSTILE_BLOCKS, per):
        hashes = list(range(10_000 + start, 10_000 + start + per))
        parent = None if start == 0 else 10_000 + start - 1
        events.append(stored(hashes, parent, [7] * (per * BLOCK)))
    events.append(stored([b"h" * 100_000], None, [1] * BLOCK))
    return events


def kvevents_slice() -> int:
    from kvferry.router import kvevents

    return kvevents.SLICE_UNITS


def router_config(tmp_path: Path) -> dict[str, Any]:
    def entry(role: str, port: int) -> dict[str, Any]:
        e = {"url": f"http://127.0.0.1:{port}", "engine_id": f"{role}-0", "side_host": "127.0.0.1",
             "side_port": port}  # fmt: skip
        return {**e, "kv_events": f"ipc://{tmp_path}/pub"} if role == "decode" else e

    static = {"prefill": [entry("prefill", 9)], "decode": [entry("decode", 10)]}
    return {"mode": "kvferry", "model": "tiny", "routing": {"block_tokens": BLOCK},
            "discovery": {"static": static}}  # fmt: skip


async def _until(check: Callable[[], bool], what: str, step: Callable[[], None] = lambda: None) -> None:
    for _ in range(400):  # at most ~20 s
        if check():
            return
        step()
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {what}")


def test_a_request_is_served_between_the_slices_of_a_huge_batch(tmp_path: Path) -> None:
    timeline: list[tuple[str, int]] = []  # ("stored", blocks) per index update, ("served", 0) per answer
    sent, answer = threading.Event(), {}

    async def scenario() -> None:
        app = build_app(parse_config(router_config(tmp_path)))

        async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
            if request.path == "/livez":
                timeline.append(("served", 0))

        app.on_response_prepare.append(on_prepare)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        index = app[STATE].index
        real_stored = index.stored

        def recording_stored(engine: str, keys: Any) -> None:
            real_stored(engine, keys)
            timeline.append(("stored", len(keys)))
            if len(keys) > 1 and not sent.is_set():
                go.set()  # the hostile batch is being applied: the client sends its request now
                assert sent.wait(10), "the client thread did not send"

        index.stored = recording_stored
        go = threading.Event()
        client = socket.create_connection(("127.0.0.1", port), timeout=30)

        def request() -> None:
            go.wait(30)
            client.sendall(b"GET /livez HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n")
            sent.set()
            answer["raw"] = client.recv(4096)

        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        try:
            probe = list(range(BLOCK))
            probe_keys = prompt_keys(probe, BLOCK, 4.0).keys
            url = "http://127.0.0.1:10"
            # PUB/SUB drops what is sent before the subscription arrives: resend the probe until seen.
            await _until(lambda: index.match(url, probe_keys) == 1, "the probe batch",
                         lambda: pub.send_multipart(frame(0, [stored([1], None, probe)])))  # fmt: skip
            timeline.clear()
            await pub.send_multipart(frame(1, hostile_events()))
            await _until(lambda: index.blocks(url) >= HOSTILE_BLOCKS, "the hostile batch applied")
            await asyncio.to_thread(thread.join, 30)
        finally:
            pub.close(linger=0)
            ctx.destroy(linger=0)
            client.close()
            answer["metrics"] = app[STATE].metrics.render()
            await runner.cleanup()

    asyncio.run(scenario())
    assert answer.get("raw", b"").startswith(b"HTTP/1.1 200"), answer
    slices = [n for what, n in timeline if what == "stored"]
    assert sum(slices) == HOSTILE_BLOCKS and max(slices) <= SLICE, slices[:5]
    assert kvevents_slice() == SLICE
    served = timeline.index(("served", 0))
    assert served < len(timeline) - 1, "the request was answered only after the whole batch"
    refused = b'kvferry_router_kv_event_dropped_total{reason="refused",role="decode"} 1.0'
    assert refused in answer["metrics"]  # the oversized hash, dropped and counted


def test_a_frame_past_the_cap_is_dropped_and_the_feed_follows_on(tmp_path: Path) -> None:
    """libzmq closes a connection that carries a frame past MAXMSGSIZE and never reconnects it: the
    feed would go blind to the engine for good. It takes a new connection (resync `reconnect`)."""
    from kvferry.router.config import Endpoint
    from kvferry.router.kvfeed import KvEventFeed
    from kvferry.router.metrics import RouterMetrics
    from kvferry.router.prefix import PrefixIndex

    url, metrics, index = "http://decode-0:8000", RouterMetrics(), PrefixIndex(1000)
    ep = Endpoint("decode", url, "decode-0", "10.0.0.2", 5600, kv_events=f"ipc://{tmp_path}/pub")

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{tmp_path}/pub")
        feed = KvEventFeed(index, BLOCK, metrics)
        feed.sync([ep])
        seq = iter(range(1_000_000))
        try:
            before, after = list(range(BLOCK)), list(range(100, 100 + BLOCK))
            first = prompt_keys(before, BLOCK, 4.0).keys
            send = lambda hashes, tokens: pub.send_multipart(frame(next(seq), [stored(hashes, None, tokens)]))  # noqa: E731
            await _until(lambda: index.match(url, first) == 1, "the first batch", lambda: send([1], before))
            await pub.send_multipart([b"kv", next(seq).to_bytes(8, "big"), b"\0" * (2 << 20)])
            later = prompt_keys(after, BLOCK, 4.0).keys
            await _until(lambda: index.match(url, later) == 1, "a batch after it", lambda: send([2], after))
        finally:
            await feed.stop()
            pub.close(linger=0)
            ctx.destroy(linger=0)

    asyncio.run(scenario())
    assert (
        'kvferry_router_kv_event_resyncs_total{reason="reconnect",role="decode"}' in metrics.render().decode()
    )
