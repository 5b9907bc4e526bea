"""Side-channel step: a tiny TCP server per engine rank that hands out its `PeerInfo`, and the fetch.

Why our own and not NIXL's listener thread: NIXL's listener needs the agent in STRICT sync mode and
a thread of its own touching the agent; ours never touches the agent (it serves bytes prepared once
at start), so the transport thread stays the agent's only user. It also carries our layout and an
incarnation id next to the agent metadata, so a restarted peer with the same engine id is noticed.

Protocol (sideauth.py): on accept the server sends a challenge (a fresh nonce and whether it wants
a proof); the client sends `KVF?`, its agent name and an HMAC of the CR's transfer token over the
nonce; only when the proof checks does the server answer with a 4-byte big-endian length and the
encoded PeerInfo, then close. A wrong proof, a malformed request or one not complete within
`request_s` closes the connection without an answer and is counted (`on_auth_failure`, by a
reason of sideauth.FAILURE_REASONS) and logged rate-limited; it costs other clients nothing.

Bounds (the port is reachable by anything in the pod network): one selector thread serves all
clients at once with non-blocking sockets, so no client can hold up another's handshake; each
connection gets `deadline_s` for the whole exchange (not per read, so trickling bytes does not
extend it) and `request_s` of it to send its request (at most sideauth.MAX_REQUEST bytes). At
most `max_clients` are open, and `max_per_host` from one host: a connection over either bound
makes room by closing the oldest idle one (request not complete) of its own host, or of the host
holding the most, so a flood of idle connections from one pod evicts only its own, never an honest
peer's handshake (which sends its request at once); with no idle one to close, the newcomer is
closed. Client misbehaviour is
counted in `stats` and logged rate-limited. `fetch_peer` bounds a whole attempt by `timeout_s` the
same way and reads at most what a real PeerInfo can need (wire.MAX_PEER_INFO), so a hostile peer
cannot stall or flood the engine's handshake either.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.connector import sideauth
from kvferry.connector.ratelimit import RateLimitedLog
from kvferry.connector.sideauth import REQUEST, SideAuth
from kvferry.connector.wire import MAX_PEER_INFO, PeerInfo, WireError, decode

log = logging.getLogger(__name__)
NO_AUTH = SideAuth(None)
MAX_PAYLOAD = MAX_PEER_INFO  # computed from the wire's bounds (~4.5 MiB), not a round guess
_BACKLOG = 128
_ACCEPT_BATCH = 64  # per wake-up, so a connect flood cannot starve clients already being served
_ACCEPT_PAUSE_S = 0.1  # after accept() fails (EMFILE...): the listener stays readable, do not spin
_TICK_S = 1.0  # longest sleep: rate-limited summaries of quiet keys still get out
_RECV_CHUNK = 1 << 18
_WAKE = object()
_REFUSED = "closed without an answer: our proof was refused (not this CR's transfer token?)"


class SideChannelError(RuntimeError):
    """The peer's side channel could not be reached or answered garbage."""


class PeerRefused(SideChannelError):
    """Nothing listens at the peer's side-channel address (connection refused): the process that
    served it is gone. A timeout is not this: a frozen or slow peer may still be alive."""


@dataclass
class SideChannelStats:
    """Connection outcomes since start; written by the server thread only."""

    served: int = 0
    refused: int = 0  # over max_clients or max_per_host with no idle client to evict: closed at once
    evicted: int = 0  # idle (request not complete) and closed to make room for a newer connection
    bad_request: int = 0  # sent something other than a request: closed without an answer
    bad_proof: int = 0  # a request whose proof does not answer its nonce: closed without an answer
    timed_out: int = 0  # exchange not finished within deadline_s
    dropped: int = 0  # closed or reset by the client, or a socket error, before the answer was out


@dataclass
class _Client:
    sock: socket.socket
    fd: int
    peer: str
    host: str
    deadline: float
    request_by: float  # the request must be complete by then
    nonce: bytes
    got: bytearray = field(default_factory=bytearray)
    need: int = sideauth.REQUEST_HEAD  # request bytes expected so far (the head says the rest)
    out: memoryview | None = None  # answer still to send, once the request is complete


class SideChannelServer:
    """Serves one encoded PeerInfo on host:port from a daemon thread until `close()`."""

    def __init__(
        self,
        host: str,
        port: int,
        payload: bytes,
        *,
        max_clients: int = 64,
        max_per_host: int = 16,
        deadline_s: float = 2.0,
        request_s: float = 1.0,
        on_contact: Callable[[], None] | None = None,
        auth: SideAuth = NO_AUTH,
        on_auth_failure: Callable[[str], None] | None = None,
    ) -> None:
        """`on_contact` runs (on the server thread) for every accepted connection: a peer fetching our
        metadata is about to connect through NIXL, which needs our agent's progress to complete.
        `max_per_host`: a TP engine's ranks fetch at once from one pod IP, with retries.
        `auth`: the token requests must prove (mode none: any request is answered);
        `on_auth_failure(reason)` runs on the server thread for every client closed unanswered."""
        if max_clients < 1 or max_per_host < 1 or deadline_s <= 0 or request_s <= 0:
            raise ValueError("max_clients, max_per_host must be >= 1; deadline_s, request_s > 0")
        self.max_clients, self.max_per_host, self.deadline_s = max_clients, max_per_host, deadline_s
        self.request_s = min(request_s, deadline_s)
        self._of_host: dict[str, dict[int, None]] = {}  # host -> its clients' fds, oldest first
        self._on_contact, self._auth, self._on_auth_failure = on_contact, auth, on_auth_failure
        self.stats = SideChannelStats()
        self._payload = struct.pack(">I", len(payload)) + payload
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=_BACKLOG)
        self._sock.setblocking(False)
        self.address = self._sock.getsockname()[:2]
        self._where = f"side channel {self.address[0]}:{self.address[1]}"
        self._clients: dict[int, _Client] = {}
        self._limited = RateLimitedLog(interval_s=10.0, max_keys=16)
        self._accept_paused_until: float | None = None
        self._wake_r, self._wake_w = socket.socketpair()  # close() interrupts select() through it
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvferry-side-{port}", daemon=True)
        self._thread.start()

    @property
    def active(self) -> int:
        """Connections currently open (accepted and not yet closed)."""
        return len(self._clients)

    @property
    def answering(self) -> int:
        """Connections whose request was read, being answered (never evicted as idle)."""
        while True:
            try:
                return sum(c.out is not None for c in list(self._clients.values()))
            except RuntimeError:  # the server thread changed the map meanwhile: look again
                continue

    def close(self) -> None:
        """Stop serving, close every connection and the port; returns promptly, safe to repeat."""
        self._stop.set()
        with contextlib.suppress(OSError):  # already closed by an earlier close()
            self._wake_w.send(b"\0")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self._wake_w.close()

    # The server thread.

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._round()
        except Exception:  # a bug, not a client: say so loudly rather than die silently
            log.exception(
                "%s: serving loop failed; peers can no longer handshake with this rank", self._where
            )
        finally:
            self._shutdown()

    def _round(self) -> None:
        now = time.monotonic()
        self._expire(now)
        self._maybe_resume_accept(now)
        for key, _ in self._sel.select(self._sleep_s(now)):
            if key.data is _WAKE:
                return
            if key.data is None:
                self._accept()
            else:
                self._service(key.data)
        self._limited.flush()

    def _sleep_s(self, now: float) -> float:
        wake = [
            now + _TICK_S,
            *(c.request_by if c.out is None else c.deadline for c in self._clients.values()),
        ]
        if self._accept_paused_until is not None:
            wake.append(self._accept_paused_until)
        return max(0.0, min(wake) - now)

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors or buffers
                self._pause_accept(exc)
                return
            host, peer = addr[0], f"{addr[0]}:{addr[1]}"
            if not self._make_room(host):
                self.stats.refused += 1
                conn.close()
                self._warn(
                    "refused", "%s: %d clients busy being answered, refused %s", len(self._clients), peer
                )
                continue
            conn.setblocking(False)
            challenge, nonce = self._auth.challenge()
            try:  # 38 bytes into a fresh socket's empty buffer: all of it, or the client is gone
                sent = conn.send(challenge)
            except OSError:
                sent = 0
            if sent != len(challenge):
                self.stats.dropped += 1
                conn.close()
                continue
            if self._on_contact is not None:
                self._on_contact()
            now = time.monotonic()
            client = _Client(
                conn, conn.fileno(), peer, host, now + self.deadline_s, now + self.request_s, nonce
            )
            self._clients[client.fd] = client
            self._of_host.setdefault(host, {})[client.fd] = None
            self._sel.register(conn, selectors.EVENT_READ, client)

    def _make_room(self, host: str) -> bool:
        """Room for one more connection from `host`: evict the oldest idle client of `host` when it is
        at max_per_host, or of the host holding the most when all are taken; False if none is idle."""
        mine = self._of_host.get(host, {})
        if len(mine) >= self.max_per_host:
            victims = mine
        elif len(self._clients) >= self.max_clients:
            victims = max(self._of_host.values(), key=len)
        else:
            return True
        idle = next((self._clients[fd] for fd in victims if self._clients[fd].out is None), None)
        if idle is None:
            return False
        self.stats.evicted += 1
        self._close(idle)
        self._warn("evicted", "%s: closed idle client %s to make room", idle.peer)
        return True

    def _pause_accept(self, exc: OSError) -> None:
        self._warn("accept", "%s: accept failed, pausing %.1fs: %s", _ACCEPT_PAUSE_S, exc)
        self._sel.unregister(self._sock)
        self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S

    def _maybe_resume_accept(self, now: float) -> None:
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._sel.register(self._sock, selectors.EVENT_READ, None)
            self._accept_paused_until = None

    def _service(self, c: _Client) -> None:
        if self._clients.get(c.fd) is not c:
            return  # closed earlier in this round; its descriptor may already belong to another
        try:
            if c.out is None:
                self._read(c)
            else:
                self._write(c)
        except OSError as exc:
            self._drop(c, "client %s dropped: %s", c.peer, exc)

    def _read(self, c: _Client) -> None:
        chunk = c.sock.recv(c.need - len(c.got))
        if not chunk:
            self._drop(c, "client %s closed after %d of %d request bytes", c.peer, len(c.got), c.need)
            return
        c.got += chunk
        if c.got[: len(REQUEST)] != REQUEST[: len(c.got)]:
            self.stats.bad_request += 1
            self._refuse(c, sideauth.MALFORMED)
            self._warn("bad request", "%s: bad request %r from %s, closed", bytes(c.got[:8]), c.peer)
            return
        if len(c.got) == sideauth.REQUEST_HEAD:
            c.need = sideauth.request_size(bytes(c.got))
        if len(c.got) < c.need:
            return
        if not self._auth.check(c.nonce, bytes(c.got)):
            self.stats.bad_proof += 1
            self._refuse(c, sideauth.BAD_PROOF)
            name = bytes(c.got[sideauth.REQUEST_HEAD : -sideauth.PROOF_BYTES])
            self._warn("bad proof", "%s: client %s (agent %r) has no valid proof, closed", c.peer, name)
        else:
            c.out = memoryview(self._payload)
            self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
            self._write(c)  # usually fits the socket buffer: no extra round through select()

    def _write(self, c: _Client) -> None:
        assert c.out is not None
        c.out = c.out[c.sock.send(c.out) :]
        if not c.out:
            self.stats.served += 1
            self._close(c)

    def _expire(self, now: float) -> None:
        late = [c for c in self._clients.values() if now >= (c.request_by if c.out is None else c.deadline)]
        for c in late:
            self.stats.timed_out += 1
            if c.out is None:
                self._refuse(c, sideauth.TIMEOUT)
            self._close(c)
            stage = "request" if c.out is None else "answer"
            msg = "%s: client %s timed out after %.1fs (in %s), closed"
            self._limited.log(log, logging.INFO, "timeout", msg, self._where, c.peer, self.deadline_s, stage)

    def _refuse(self, c: _Client, reason: str) -> None:
        """Close `c` unanswered and count why."""
        self._close(c)
        if self._on_auth_failure is not None:
            self._on_auth_failure(reason)

    def _drop(self, c: _Client, msg: str, *args: object) -> None:
        self.stats.dropped += 1
        self._close(c)
        self._limited.log(log, logging.DEBUG, "dropped", "%s: " + msg, self._where, *args)

    def _warn(self, key: str, msg: str, *args: object) -> None:
        self._limited.log(log, logging.WARNING, key, msg, self._where, *args)

    def _close(self, c: _Client) -> None:
        if self._clients.pop(c.fd, None) is not None:
            self._sel.unregister(c.sock)
            mine = self._of_host[c.host]
            del mine[c.fd]
            if not mine:
                del self._of_host[c.host]
        c.sock.close()

    def _shutdown(self) -> None:
        for c in list(self._clients.values()):
            self._close(c)
        self._sel.close()
        self._sock.close()
        self._wake_r.close()
        self._limited.flush(force=True)


def fetch_peer(host: str, port: int, timeout_s: float, auth: SideAuth = NO_AUTH, name: str = "") -> PeerInfo:
    """One attempt, bounded by `timeout_s` in total, to read a peer's PeerInfo, proving `auth`'s
    token as agent `name`; raises SideChannelError naming the peer."""
    where = f"side channel {host}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.settimeout(_remaining(deadline))
            challenge = _recv_exact(conn, sideauth.CHALLENGE_SIZE, deadline)
            conn.sendall(auth.request(challenge, name))
            head = _recv_exact(conn, 4, deadline, refused=_REFUSED)
            (size,) = struct.unpack(">I", head)
            if size > MAX_PAYLOAD:
                raise SideChannelError(f"payload of {size} bytes is too large")
            info = decode(_recv_exact(conn, size, deadline))
    except ConnectionRefusedError as exc:
        raise PeerRefused(f"{where}: {exc}") from None
    except OSError as exc:
        raise SideChannelError(f"{where}: {exc}") from None
    except (WireError, SideChannelError, sideauth.AuthError) as exc:
        raise SideChannelError(f"{where}: {exc}") from None
    if not isinstance(info, PeerInfo):
        raise SideChannelError(f"{where}: answered a {type(info).__name__}, not peer info")
    return info


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _recv_exact(conn: socket.socket, n: int, deadline: float, refused: str = "") -> bytes:
    data = bytearray()
    while len(data) < n:
        conn.settimeout(_remaining(deadline))  # the whole read, not each recv: trickling does not help
        chunk = conn.recv(min(n - len(data), _RECV_CHUNK))
        if not chunk and not data and refused:
            raise SideChannelError(refused)
        if not chunk:
            raise SideChannelError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)
