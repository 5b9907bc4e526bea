"""sidechannel + sideauth: only a client proving the CR's transfer token gets a rank's agent metadata.

The proof is pure (sideauth); the exchange runs on real sockets on 127.0.0.1, every wait bounded.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from kvferry.connector import sideauth
from kvferry.connector.sideauth import (
    CHALLENGE_SIZE,
    MAX_REQUEST,
    PROOF_BYTES,
    REQUEST_HEAD,
    AuthError,
    SideAuth,
)
from kvferry.connector.sidechannel import SideChannelError, SideChannelServer, fetch_peer
from kvferry.connector.wire import encode
from kvferry.contracts import pods
from kvferry.contracts.versions import SIDE_CHANNEL_VERSION

from tests.unit.connector.test_sidechannel_is_bounded_under_hostile_clients import peer_info
from tests.waiting import wait_until

TOKEN = SideAuth(b"k" * 43)
OTHER = SideAuth(b"x" * 43)


# ---- the proof (pure) ----


def test_the_right_token_answers_and_any_other_is_refused() -> None:
    challenge, nonce = TOKEN.challenge()
    assert len(challenge) == CHALLENGE_SIZE and challenge[4] == SIDE_CHANNEL_VERSION
    assert TOKEN.check(nonce, TOKEN.request(challenge, "decode-0/0/ab"))
    assert not TOKEN.check(nonce, OTHER.request(challenge, "decode-0/0/ab"))
    zero = SideAuth(None).request(SideAuth(None).challenge()[0], "decode-0/0/ab")  # an all-zero proof
    assert not TOKEN.check(nonce, zero)


def test_a_proof_answers_one_nonce_and_one_name_only() -> None:
    first, nonce1 = TOKEN.challenge()
    _, nonce2 = TOKEN.challenge()
    assert nonce1 != nonce2  # fresh per connection
    recorded = TOKEN.request(first, "decode-0/0/ab")
    assert not TOKEN.check(nonce2, recorded)  # replayed to another connection
    renamed = recorded[:REQUEST_HEAD] + b"decode-0/0/ac" + recorded[-PROOF_BYTES:]
    assert not TOKEN.check(nonce1, renamed)  # the name is inside the proof


def test_a_client_without_the_token_is_told_so_before_it_sends_anything() -> None:
    with pytest.raises(AuthError, match=pods.TRANSFER_TOKEN_ENV):
        SideAuth(None).request(TOKEN.challenge()[0], "d")


def test_requests_are_bounded_and_challenges_checked() -> None:
    request = TOKEN.request(TOKEN.challenge()[0], "n" * 10_000)
    assert len(request) == MAX_REQUEST == sideauth.request_size(request[:REQUEST_HEAD])
    bad_version = bytearray(TOKEN.challenge()[0])
    bad_version[4] = 1
    with pytest.raises(AuthError, match="version 1"):
        sideauth.parse_challenge(bytes(bad_version))
    with pytest.raises(AuthError, match="not a side-channel challenge"):
        sideauth.parse_challenge(b"\x00\x00\x00\x04" + bytes(CHALLENGE_SIZE - 4))


def test_the_token_file(tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.setattr(sideauth, "_warned", False)
    caplog.set_level(logging.WARNING, logger="kvferry.connector.sideauth")
    assert sideauth.load({}).mode == "none" and sideauth.load({}).token is None
    assert len([r for r in caplog.records if "unauthenticated" in r.getMessage()]) == 1  # once
    good = tmp_path / "token"
    good.write_text("c2VjcmV0LXRva2VuLW9mLTMyLWJ5dGVzLWhlcmUhIQ==\n")
    loaded = sideauth.load({pods.TRANSFER_TOKEN_ENV: str(good)})
    assert loaded.mode == "token" and loaded.token == good.read_bytes().strip()
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(AuthError, match="got 3"):
        sideauth.load({pods.TRANSFER_TOKEN_ENV: str(short)})
    with pytest.raises(AuthError, match="missing"):  # named but absent: an error, never mode none
        sideauth.load({pods.TRANSFER_TOKEN_ENV: str(tmp_path / "missing")})


# ---- real sockets ----


class Server:
    def __init__(self, auth: SideAuth, **kw: float) -> None:
        self.failures: list[str] = []
        self.info = peer_info()
        self.side = SideChannelServer(
            "127.0.0.1", 0, encode(self.info), auth=auth, on_auth_failure=self.failures.append, **kw
        )
        self.port = self.side.address[1]

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *_: object) -> None:
        self.side.close()


def test_only_a_client_with_the_token_gets_the_metadata() -> None:
    with Server(TOKEN) as s:
        assert fetch_peer("127.0.0.1", s.port, 2.0, TOKEN, "decode-0/0/ab") == s.info
        with pytest.raises(SideChannelError, match="proof was refused"):
            fetch_peer("127.0.0.1", s.port, 2.0, OTHER, "intruder")
        with pytest.raises(SideChannelError, match=pods.TRANSFER_TOKEN_ENV):
            fetch_peer("127.0.0.1", s.port, 2.0)  # no token: the client never sends a request
        wait_until(lambda: s.side.stats.bad_proof, "1 bad proof", 5, 0.01, until=lambda n: n == 1)
        assert s.side.stats.served == 1
        # the tokenless client hung up after the challenge: dropped, not a refusal
        wait_until(lambda: s.side.stats.dropped, "1 dropped", 5, 0.01, until=lambda n: n == 1)
        assert s.failures == [sideauth.BAD_PROOF]


def _raw(port: int) -> tuple[socket.socket, bytes]:
    conn = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    return conn, conn.recv(CHALLENGE_SIZE, socket.MSG_WAITALL)


def _answer(conn: socket.socket) -> bytes:
    data = bytearray()
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


def test_a_recorded_request_replayed_on_a_new_connection_gets_nothing() -> None:
    with Server(TOKEN) as s:
        conn, challenge = _raw(s.port)
        recorded = TOKEN.request(challenge, "decode-0/0/ab")
        with conn:
            conn.sendall(recorded)
            assert len(_answer(conn)) == 4 + len(encode(s.info))  # the honest exchange is answered
        replay, _ = _raw(s.port)
        with replay:
            replay.sendall(recorded)
            assert _answer(replay) == b""
        wait_until(lambda: s.failures, "replay refused", 5, 0.01, until=lambda f: f == [sideauth.BAD_PROOF])


def test_a_slow_client_without_a_proof_is_closed_in_bounded_time_and_blocks_no_one() -> None:
    with Server(TOKEN, request_s=0.5, deadline_s=5.0) as s:
        slow, challenge = _raw(s.port)
        with slow:
            slow.sendall(TOKEN.request(challenge, "slow")[:REQUEST_HEAD])  # the head, never the proof
            start = time.monotonic()
            assert fetch_peer("127.0.0.1", s.port, 2.0, TOKEN, "honest") == s.info  # not held up
            assert time.monotonic() - start < 0.4
            assert _answer(slow) == b""
            assert 0.3 < time.monotonic() - start < 2.0  # closed at request_s
        wait_until(lambda: s.failures, "timeout counted", 5, 0.01, until=lambda f: f == [sideauth.TIMEOUT])


def test_a_tokenless_server_answers_everyone_and_says_so() -> None:
    with Server(SideAuth(None)) as s:
        results: list[object] = []
        threads = [
            threading.Thread(target=lambda a=a: results.append(fetch_peer("127.0.0.1", s.port, 2.0, a)))
            for a in (TOKEN, SideAuth(None))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(5)
        assert results == [s.info, s.info] and s.failures == []
    assert SideAuth(None).mode == "none" and TOKEN.mode == "token"
