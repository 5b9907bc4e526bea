"""The connector's `kvferry_*` metric names, and the labels and values others read from them.

The connector exports them on vLLM's /metrics (connector/metrics.py); the operator's status timer
(operator/status/transfer.py), the dashboard (dashboards/kvferry.json) and the tools read them; each is
documented in docs/metrics.md. Names are prometheus_client family names: a counter's samples end in
`_total` (`total()`), a histogram's in `_bucket`, `_sum` and `_count`.
"""

from __future__ import annotations

TRANSFERS = "kvferry_transfers"
TRANSFER_FAILURES = "kvferry_transfer_failures"
REJECTED_MESSAGES = "kvferry_rejected_messages"
TRANSFER_BYTES = "kvferry_transfer_bytes"
DESCRIPTORS_PER_TRANSFER = "kvferry_descriptors_per_transfer"
DESCRIPTOR_PREP_SECONDS = "kvferry_descriptor_prep_seconds"
REGISTRATION_TO_MATCH_SECONDS = "kvferry_registration_to_match_seconds"
MATCH_TO_DONE_SECONDS = "kvferry_match_to_done_seconds"  # producer: WRITE start to done
PREFILL_HANDOFFS = "kvferry_prefill_handoffs"
RECEIVE_WAIT_SECONDS = "kvferry_receive_wait_seconds"
PENDING = "kvferry_pending"
HANDSHAKES = "kvferry_handshakes"
PRODUCER_PROBES = "kvferry_producer_probes"  # consumer: liveness checks of silent producers, by result
PREFLIGHT_OK = "kvferry_preflight_ok"
PREFIX_TOKENS_HELD = "kvferry_prefix_tokens_held"  # consumer: prompt tokens already cached, not pushed
PUSHED_TOKENS = "kvferry_pushed_tokens"  # producer: prompt tokens written by completed WRITEs
PUSHED_BLOCKS = "kvferry_pushed_blocks"  # producer: consumer blocks written by completed WRITEs
ENDPOINT_ROUNDS = "kvferry_endpoint_rounds"  # wake-ups of the endpoint thread
ENDPOINT_CPU_SECONDS = "kvferry_endpoint_cpu_seconds"  # CPU time of the endpoint thread
STEP_HOOK_SECONDS = "kvferry_step_hook_seconds"  # time in the connector's hooks on vLLM's worker thread
STEPS = "kvferry_steps"  # engine steps those hooks ran in
SENTINEL_CHECKS = "kvferry_sentinel_checks"  # consumer: sampled KV checks on landing, by result
TRANSFER_AUTH = "kvferry_transfer_auth"  # 1 on the side channel's auth mode: token, or none (unauthenticated)
SIDE_AUTH_FAILURES = "kvferry_side_channel_auth_failures"  # side-channel clients closed unanswered, by reason

# Labels the operator reads.
BACKEND = "backend"  # on any kvferry_* sample: the NIXL backend that moved the bytes
REASON = "reason"  # on TRANSFER_FAILURES
CHECK = "check"  # on PREFLIGHT_OK
KIND = "kind"  # on PENDING: which bounded map

# Label values the operator acts on.
LAYOUT_MISMATCH = "layout_mismatch"  # TRANSFER_FAILURES reason: P's and D's KV layouts cannot be mapped
# TRANSFER_FAILURES reason (consumer): the sentinel's sampled KV in decode's blocks is not what prefill sent
SAMPLE_MISMATCH = "sample_mismatch"
# PENDING kind (consumer): receives held past deadline + grace for a producer that never answered
HELD = "held"
CHECK_BACKEND = "backend_"  # PREFLIGHT_OK check prefix + NIXL backend name: 1 when its plugin loaded
CHECK_UCX_ON_EFA = "ucx_on_efa"  # PREFLIGHT_OK check: 0 when UCX was chosen on a host with EFA devices
CHECK_MEMLOCK = "memlock"  # PREFLIGHT_OK check: 0 when LIBFABRIC cannot lock memory (ulimit -l, no IPC_LOCK)
CHECK_NCCL_NET = "nccl_net"  # PREFLIGHT_OK check: 0 when a multi-node group's NCCL would fall back to sockets


def total(name: str) -> str:
    """The sample name of a counter family."""
    return f"{name}_total"
