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
