"""kvferry.connector: push-mode KV transfer for vLLM over NIXL, plus the P/D router.

vLLM loads the connector class from here through
`"kv_connector_module_path": "kvferry.connector"` (see connector/README.md).
"""
