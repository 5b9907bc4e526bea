"""Side-channel authentication: the challenge, the proof and the token they are keyed with (pure).

Why: a rank's side channel hands out its NIXL agent metadata, and with it anyone who reaches the pod
can WRITE into that rank's KV blocks. The operator creates one random token per DisaggregatedInference
in a Secret and mounts it into both roles (`KVFERRY_TRANSFER_TOKEN_FILE`); a client proves it holds
the token before the server answers, without the token ever crossing the wire:

  server, on accept:  CHALLENGE_MAGIC, version, mode (0 none, 1 token), 32-byte random nonce
  client:             REQUEST, name length (1 byte), its agent name, 32-byte proof
  proof = HMAC-SHA256(token, CONTEXT || nonce || name length || name)

A proof answers one nonce only (a fresh one per connection), so a recorded exchange cannot be
replayed. Without the env var a rank runs unauthenticated (mode none: local tools and tests that start
engines without the operator), says so once in its log and in `kvferry_transfer_auth{mode="none"}`;
the operator always sets it. A variable naming a missing, empty or short file is an error at start,
never a silent downgrade.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvferry.contracts import pods, versions

log = logging.getLogger(__name__)
REQUEST = b"KVF?"  # the client's request starts with it (the seed protocol's whole request)
CHALLENGE_MAGIC = b"KVF!"
VERSION = versions.SIDE_CHANNEL_VERSION
NONCE_BYTES = 32
PROOF_BYTES = 32  # SHA-256
MAX_NAME = 255  # an agent name's bytes (its length travels in one byte)
CHALLENGE_SIZE = len(CHALLENGE_MAGIC) + 2 + NONCE_BYTES
REQUEST_HEAD = len(REQUEST) + 1  # REQUEST and the name's length: the rest's size follows from them
MAX_REQUEST = REQUEST_HEAD + MAX_NAME + PROOF_BYTES
CONTEXT = b"kvferry side channel proof v2\0"  # keys proofs to this use of the token only
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 4096
MODE_NONE, MODE_TOKEN = 0, 1
MODES = {MODE_NONE: "none", MODE_TOKEN: "token"}
# Why a client got no answer: the `reason` label of kvferry_side_channel_auth_failures (bounded).
BAD_PROOF, MALFORMED, TIMEOUT = "bad_proof", "malformed", "timeout"
FAILURE_REASONS = (BAD_PROOF, MALFORMED, TIMEOUT)
_warned = False


class AuthError(ValueError):
    """A challenge or request that is not the protocol's, or a token file that cannot be used."""


@dataclass(frozen=True)
class SideAuth:
    """The token a rank proves and checks proofs with; None: unauthenticated (mode none)."""

    token: bytes | None = None

    @property
    def mode(self) -> str:
        return MODES[MODE_TOKEN if self.token is not None else MODE_NONE]

    def challenge(self) -> tuple[bytes, bytes]:
        """(the bytes a server sends on accept, the nonce in them)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        mode = MODE_TOKEN if self.token is not None else MODE_NONE
        return CHALLENGE_MAGIC + bytes([VERSION, mode]) + nonce, nonce

    def request(self, challenge: bytes, name: str) -> bytes:
        """The client's answer to a server's challenge; raises AuthError when it cannot answer it."""
        mode, nonce = parse_challenge(challenge)
        if mode == MODE_TOKEN and self.token is None:
            raise AuthError(
                f"the peer requires a transfer token and this rank has none ({pods.TRANSFER_TOKEN_ENV})"
            )
        raw = name.encode()[:MAX_NAME]
        proof = _proof(self.token, nonce, raw) if self.token is not None else bytes(PROOF_BYTES)
        return REQUEST + bytes([len(raw)]) + raw + proof

    def check(self, nonce: bytes, request: bytes) -> bool:
        """Whether a complete `request` answers `nonce` (always true in mode none)."""
        name, proof = request[REQUEST_HEAD:-PROOF_BYTES], request[-PROOF_BYTES:]
        if self.token is None:
            return True
        return hmac.compare_digest(_proof(self.token, nonce, name), proof)


def request_size(head: bytes) -> int:
    """A request's whole size from its first REQUEST_HEAD bytes."""
    return REQUEST_HEAD + head[len(REQUEST)] + PROOF_BYTES


def parse_challenge(data: bytes) -> tuple[int, bytes]:
    """(mode, nonce) of a server's challenge; AuthError naming what is wrong."""
    if len(data) != CHALLENGE_SIZE or not data.startswith(CHALLENGE_MAGIC):
        raise AuthError(f"not a side-channel challenge: {data[:8]!r}")
    version, mode = data[len(CHALLENGE_MAGIC)], data[len(CHALLENGE_MAGIC) + 1]
    if version != VERSION:
        raise AuthError(f"side channel version {version} != ours {VERSION}")
    if mode not in MODES:
        raise AuthError(f"unknown side-channel auth mode {mode}")
    return mode, data[len(CHALLENGE_MAGIC) + 2 :]


def _proof(token: bytes, nonce: bytes, name: bytes) -> bytes:
    return hmac.new(token, CONTEXT + nonce + bytes([len(name)]) + name, hashlib.sha256).digest()


def load(environ: dict[str, str] | None = None) -> SideAuth:
    """The rank's SideAuth from `KVFERRY_TRANSFER_TOKEN_FILE` (unset: mode none, warned once)."""
    global _warned
    path = (os.environ if environ is None else environ).get(pods.TRANSFER_TOKEN_ENV, "")
    if not path:
        if not _warned:
            _warned = True
            log.warning(
                "kvferry: %s is not set: the side channel serves agent metadata to anyone who connects "
                "(unauthenticated mode, for local runs; the operator always sets it)",
                pods.TRANSFER_TOKEN_ENV,
            )
        return SideAuth(None)
    try:
        with Path(path).open("rb") as f:
            token = f.read(MAX_TOKEN_BYTES + 1).strip()
    except OSError as exc:
        raise AuthError(f"{pods.TRANSFER_TOKEN_ENV}={path}: {exc}") from None
    if not MIN_TOKEN_BYTES <= len(token) <= MAX_TOKEN_BYTES:
        raise AuthError(
            f"{pods.TRANSFER_TOKEN_ENV}={path}: a token is {MIN_TOKEN_BYTES} to {MAX_TOKEN_BYTES} bytes, "
            f"got {len(token)}"
        )
    return SideAuth(token)
