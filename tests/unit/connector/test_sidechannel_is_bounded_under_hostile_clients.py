"""sidechannel: silent, slow, garbage-sending or too many clients never hold up a real handshake.

Real sockets on 127.0.0.1; every wait is bounded so a regression fails instead of hanging.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
from kvferry.connector.sideauth import CHALLENGE_SIZE, SideAuth
from kvferry.connector.sidechannel import (
    MAX_PAYLOAD,
    SideChannelError,
    SideChannelServer,
    fetch_peer,
)
from kvferry.connector.wire import PeerInfo, encode, layout_to_wire
from kvferry.tools.hostkv import synthetic_layout

from tests.waiting import wait_until

LAYOUT = synthetic_layout(
    "head_major", bases=[4096], num_blocks=8, block_size=16, num_heads=2, head_dim=8, elem_bytes=4
)


def peer_info(metadata_bytes: int = 64) -> PeerInfo:
    meta = bytes(i % 251 for i in range(metadata_bytes))
    return PeerInfo("engine-p", "agent-p", meta, 0, 1, "inc-1", layout_to_wire(LAYOUT), LAYOUT.fingerprint)


@contextmanager
def serving(info: PeerInfo, **kw: float) -> Iterator[SideChannelServer]:
    server = SideChannelServer("127.0.0.1", 0, encode(info), **kw)
    try:
        yield server
    finally:
        server.close()


CHALLENGES: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def connect(server: SideChannelServer) -> socket.socket:
    """A connection whose challenge was read: what follows is the server's answer, if any."""
    conn = socket.create_connection(tuple(server.address), timeout=5.0)
    conn.settimeout(5.0)
    challenge = bytearray()
    while len(challenge) < CHALLENGE_SIZE and (chunk := conn.recv(CHALLENGE_SIZE - len(challenge))):
        challenge += chunk  # a refused newcomer is closed before any challenge
    CHALLENGES[conn] = bytes(challenge)
    return conn


def request(conn: socket.socket, name: str = "agent-d") -> bytes:
    """An honest unauthenticated client's request for the challenge `conn` got."""
    return SideAuth(None).request(CHALLENGES[conn], name)


def fake_peer_accept(listener: socket.socket) -> socket.socket:
    """A hand-written peer: accept, send a challenge, read the request."""
    conn, _ = listener.accept()
    conn.sendall(SideAuth(None).challenge()[0])
    conn.recv(1024)
    return conn


def read_until_closed(conn: socket.socket) -> bytes:
    """What the server sent before it closed (a reset counts as closed)."""
    data = bytearray()
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def test_fetch_succeeds_quickly_while_idle_clients_hold_connections():
    info = peer_info()
    with serving(info, max_per_host=32, request_s=2.0) as server, ExitStack() as idle:
        for _ in range(20):  # connect and never send: the old server gave each one 2 s in turn
            idle.enter_context(connect(server))
        wait_until(lambda: server.active, "20 idle clients accepted", 5, 0.01, until=lambda n: n == 20)
        start = time.monotonic()
        assert fetch_peer("127.0.0.1", server.address[1], timeout_s=1.0) == info
        assert time.monotonic() - start < 0.5


def test_garbage_is_closed_without_an_answer_and_serving_goes_on(caplog):
    info = peer_info()
    caplog.set_level(logging.DEBUG, logger="kvferry.connector.sidechannel")
    with serving(info) as server:
        for junk in (b"GET / HTTP/1.0\r\n\r\n", b"KVX?", b"KV\x00"):
            with connect(server) as conn:
                conn.sendall(junk)
                assert read_until_closed(conn) == b""
        assert fetch_peer("127.0.0.1", server.address[1], timeout_s=2.0) == info
        wait_until(
            lambda: (server.stats.bad_request, server.stats.served),
            "3 bad requests and 1 served",
            5,
            0.01,
            until=lambda seen: seen == (3, 1),
        )
    bad = [r.getMessage() for r in caplog.records if "bad request" in r.getMessage()]
    assert len(bad) == 2, bad  # rate limited: the first, then the count of the others at close()
    assert "bad request b'GET /'" in bad[0]  # the request's head: 5 bytes
    assert "(and 2 more like this" in bad[1]


def test_silent_client_is_dropped_at_the_deadline():
    with serving(peer_info(), deadline_s=0.3) as server, connect(server) as conn:
        start = time.monotonic()
        assert read_until_closed(conn) == b""
        assert 0.2 < time.monotonic() - start < 1.5
        wait_until(lambda: server.stats.timed_out, "1 timed out", 5, 0.01, until=lambda n: n == 1)
        assert server.active == 0


def test_deadline_is_for_the_whole_exchange_not_each_read():
    with serving(peer_info(), deadline_s=1.0) as server, connect(server) as conn:
        start = time.monotonic()
        for byte in request(conn)[:3]:  # each byte well within a per-read timeout; the total is not
            conn.sendall(bytes([byte]))
            time.sleep(0.4)
        assert read_until_closed(conn) == b""
        assert time.monotonic() - start < 1.6  # a per-read timeout would run to 0.8 + 1.0 s
        wait_until(lambda: server.stats.timed_out, "1 timed out", 5, 0.01, until=lambda n: n == 1)


def test_slow_but_honest_client_within_the_deadline_is_served():
    info = peer_info()
    with serving(info, deadline_s=2.0) as server, connect(server) as conn:
        for byte in request(conn)[:12]:
            conn.sendall(bytes([byte]))
            time.sleep(0.05)
        conn.sendall(request(conn)[12:])
        data = read_until_closed(conn)
        assert int.from_bytes(data[:4], "big") == len(data) - 4 == len(encode(info))


def test_many_concurrent_fetches_all_get_the_exact_payload():
    info = peer_info(metadata_bytes=1 << 20)  # larger than a socket buffer: partial sends happen
    results: list[PeerInfo | Exception] = []
    with serving(info, max_per_host=64) as server:  # 40 at once from one host: none evicted

        def fetch() -> None:
            try:
                results.append(fetch_peer("127.0.0.1", server.address[1], timeout_s=10.0))
            except Exception as exc:  # collected, asserted below
                results.append(exc)

        threads = [threading.Thread(target=fetch) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20.0)
        assert len(results) == 40
        assert all(r == info for r in results), [r for r in results if r != info][:3]
        wait_until(lambda: server.stats.served, "served == 40", 5, 0.01, until=lambda n: n == 40)


def test_a_flood_of_idle_connections_evicts_its_own_not_the_handshake():
    # was: at max_clients every newcomer was refused, so idle connections refused real handshakes
    info = peer_info()
    with serving(info, max_per_host=4, deadline_s=10.0, request_s=10.0) as server, ExitStack() as idle:
        for _ in range(100):  # one host, far over both bounds, never sending a byte
            idle.enter_context(connect(server))
        wait_until(
            lambda: (server.stats.evicted, server.active), "96 evicted, 4 open", 5, 0.01,
            until=lambda seen: seen == (96, 4),
        )  # fmt: skip
        assert server.stats.refused == 0
        # served within a timeout far below the idle ones' 10 s: one was evicted, nothing queued
        assert fetch_peer("127.0.0.1", server.address[1], timeout_s=2.0) == info


def test_idle_connections_are_closed_after_request_s():
    with serving(peer_info(), deadline_s=30.0, request_s=0.3) as server, connect(server) as conn:
        assert read_until_closed(conn) == b""  # conn's own timeout (5 s) is far below deadline_s
        wait_until(lambda: server.stats.timed_out, "1 timed out", 5, 0.01, until=lambda n: n == 1)


def test_connections_beyond_the_cap_with_none_idle_are_closed_at_once_and_counted():
    info = peer_info(metadata_bytes=3 << 20)  # far over the socket buffers: answers stay unsent
    with serving(info, max_clients=2, deadline_s=10.0) as server, ExitStack() as busy:
        for _ in range(2):  # a complete request, then never read: each stays busy being answered
            conn = socket.socket()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.connect(tuple(server.address))
            challenge = conn.recv(CHALLENGE_SIZE, socket.MSG_WAITALL)
            conn.sendall(SideAuth(None).request(challenge, "busy"))
            busy.enter_context(conn)
        # both requests read, not only accepted: a client still sending its request counts as idle
        wait_until(lambda: server.answering, "answering == 2", 5, 0.01, until=lambda n: n == 2)
        with connect(server) as extra:  # closed at once (its 5 s timeout is below deadline_s)
            assert read_until_closed(extra) == b""
        wait_until(lambda: server.stats.refused, "refused == 1", 5, 0.01, until=lambda n: n == 1)
        busy.close()
        wait_until(lambda: server.active, "active == 0", 5, 0.01, until=lambda n: n == 0)
        assert fetch_peer("127.0.0.1", server.address[1], timeout_s=5.0) == info


def test_an_answer_larger_than_any_real_peer_info_is_refused_unread():
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def lie() -> None:
            with fake_peer_accept(listener) as conn:
                conn.sendall((MAX_PAYLOAD + 1).to_bytes(4, "big"))

        t = threading.Thread(target=lie)
        t.start()
        with pytest.raises(SideChannelError, match="too large"):
            fetch_peer("127.0.0.1", listener.getsockname()[1], timeout_s=2.0)
        t.join(5)
    assert MAX_PAYLOAD < 8 << 20  # was 64 MiB


def test_close_is_prompt_with_clients_connected():
    server = SideChannelServer("127.0.0.1", 0, encode(peer_info()))
    port = server.address[1]
    with ExitStack() as idle:
        conns = [idle.enter_context(connect(server)) for _ in range(5)]
        wait_until(lambda: server.active, "active == 5", 5, 0.01, until=lambda n: n == 5)
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 0.5
        assert all(read_until_closed(c) == b"" for c in conns)
    with pytest.raises(SideChannelError):
        fetch_peer("127.0.0.1", port, timeout_s=1.0)
    server.close()  # idempotent


def test_fetch_from_a_trickling_peer_gives_up_at_its_timeout():
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:  # a hostile peer: a length, then one byte now and then, forever
        with fake_peer_accept(listener) as conn:
            conn.sendall((1000).to_bytes(4, "big"))
            while not stop.is_set():
                try:
                    conn.sendall(b"x")
                except OSError:
                    return
                time.sleep(0.1)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(SideChannelError, match=r"127\.0\.0\.1:\d+: timed out"):
            fetch_peer("127.0.0.1", listener.getsockname()[1], timeout_s=0.5)
        assert time.monotonic() - start < 1.5
    finally:
        stop.set()
        thread.join(timeout=2.0)
        listener.close()


def test_peer_closing_early_is_an_error_naming_the_peer():
    listener = socket.create_server(("127.0.0.1", 0))

    def hang_up() -> None:
        with fake_peer_accept(listener) as conn:
            conn.sendall((1000).to_bytes(4, "big") + b"short")

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        with pytest.raises(
            SideChannelError, match=rf"side channel 127\.0\.0\.1:{port}: .*closed after 5 of 1000"
        ):
            fetch_peer("127.0.0.1", port, timeout_s=2.0)
    finally:
        thread.join(timeout=2.0)
        listener.close()
