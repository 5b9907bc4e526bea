"""What the operator renders into engine pods that the router and the connector rely on (contracts.md §3).

Port names are read by the router's EndpointSlice discovery; the module paths are what vLLM and the
pod's start-up step import from the connector (`kvferry inject` keeps them resolvable in stock images).
"""

from __future__ import annotations

PORT_HTTP = "http"  # vLLM's OpenAI server (8000)
PORT_SIDE_CHANNEL = "side-channel"  # the connector's agent-metadata side channel (5600 + TP rank)
# vLLM's KV-cache events (--kv-events-config), which the router follows for prefix-aware routing
# (router/kvfeed.py): the live stream (ZMQ PUB) and its replay buffer (ZMQ ROUTER).
PORT_KV_EVENTS, KV_EVENTS_PORT = "kv-events", 5557
PORT_KV_EVENTS_REPLAY, KV_EVENTS_REPLAY_PORT = "kv-replay", 5558  # port names: at most 15 characters

# --kv-transfer-config: vLLM imports CONNECTOR_MODULE and takes CONNECTOR_CLASS from it.
CONNECTOR_CLASS = "KvferryConnector"
CONNECTOR_MODULE = "kvferry.connector"
# `python3 -m PREFLIGHT_MODULE --startup` runs before vLLM in inject mode.
PREFLIGHT_MODULE = "kvferry.connector.preflight"

# The CR's transfer token (a Secret the operator creates and mounts read-only into both roles): the
# side channel answers only clients that prove they hold it (connector/sideauth.py).
TRANSFER_TOKEN_ENV = "KVFERRY_TRANSFER_TOKEN_FILE"
TRANSFER_TOKEN_DIR = "/var/run/kvferry/transfer"
TRANSFER_TOKEN_KEY = "token"  # the Secret's key, the file's name under TRANSFER_TOKEN_DIR

# The router serves its pool's transfer metrics here (router/poolstatus.py); the operator reads it, one
# request per DisaggregatedInference instead of one per engine pod (operator/status/scrape.py).
POOL_METRICS_PATH = "/kvferry/pool-metrics"
