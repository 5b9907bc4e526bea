"""Contracts shared by the operator, the connector and the router (stdlib only): the kv_transfer_params
schema (params), versions, label keys (labels), pod port names and connector module paths (pods), metric
names (metrics) and termination-message prefixes (termination). Each side imports these instead of
repeating the strings, and none imports another through anything else (docs/contracts.md is the prose).
"""
