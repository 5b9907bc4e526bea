"""Versions two parts must agree on, each written once (docs/contracts.md §1 and §3).

Bump a version only together with every reader and writer, and add a line to its history.
"""

from __future__ import annotations

# The `v` of the kvferry block in kv_transfer_params (router writes it, the connector refuses others).
#   1. request_id, attempt, role, peer identity, deadline_s.
PARAMS_VERSION = 1

# The connector's peer wire protocol (history in connector/wire.py). The operator hashes it into the
# revision, so P and D of different protocols are never paired; the connector's wire.py must equal it
# (tests/unit/operator/test_revision_covers_the_data_path.py).
WIRE_PROTOCOL_VERSION = 6

# The side channel's handshake (connector/sidechannel.py, connector/sideauth.py), apart from the wire
# messages: the PeerInfo it serves is a wire message (WIRE_PROTOCOL_VERSION), the exchange around it
# is not. Both ends check it in the challenge; docs/contracts.md §3.
#   1. the client sends `KVF?`, the server answers a length and the PeerInfo.
#   2. the server sends a challenge first (magic, version, auth mode, nonce); the client's request
#      carries its agent name and an HMAC-SHA256 proof of the CR's transfer token over the nonce.
SIDE_CHANNEL_VERSION = 2
