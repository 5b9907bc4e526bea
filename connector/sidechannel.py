"""Side-channel step: a tiny TCP server per engine rank that hands out its `PeerInfo`, and the fetch.

Why our own and not NIXL's listener thread: NIXL's listener needs the agent in STRICT sync mode and
a thread of its own touching the agent; ours never touches the agent (it serves bytes prepared once
at start), so the transport thread stays the agent's only user. It also carries our layout and an
incarnation id next to the agent metadata, so a restarted peer with the same engine id is noticed.

Protocol: the client connects and sends `KVF?`; the server answers with a 4-byte big-endian length
and the encoded PeerInfo, then closes. Every socket operation has a timeout.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading

from kvferry.connector.wire import PeerInfo, WireError, decode

log = logging.getLogger(__name__)
REQUEST = b"KVF?"
MAX_PAYLOAD = 64 << 20


class SideChannelError(RuntimeError):
    """The peer's side channel could not be reached or answered garbage."""


class SideChannelServer:
    """Serves one encoded PeerInfo on host:port from a daemon thread until `close()`."""

    def __init__(self, host: str, port: int, payload: bytes) -> None:
        self._payload = struct.pack(">I", len(payload)) + payload
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.2)  # lets the accept loop notice close() without a busy loop
        self.address = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvferry-side-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(2.0)
                    if _recv_exact(conn, len(REQUEST)) == REQUEST:
                        conn.sendall(self._payload)
                except (OSError, SideChannelError) as exc:
                    log.debug("side channel: client dropped: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2.0)


def fetch_peer(host: str, port: int, timeout_s: float) -> PeerInfo:
    """One bounded attempt to read a peer's PeerInfo; raises SideChannelError naming the peer."""
    where = f"side channel {host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(REQUEST)
            (size,) = struct.unpack(">I", _recv_exact(conn, 4))
            if size > MAX_PAYLOAD:
                raise SideChannelError(f"{where}: payload of {size} bytes is too large")
            info = decode(_recv_exact(conn, size))
    except OSError as exc:
        raise SideChannelError(f"{where}: {exc}") from None
    except WireError as exc:
        raise SideChannelError(f"{where}: {exc}") from None
    if not isinstance(info, PeerInfo):
        raise SideChannelError(f"{where}: answered a {type(info).__name__}, not peer info")
    return info


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise SideChannelError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)
