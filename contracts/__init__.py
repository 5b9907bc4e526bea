"""Contracts shared by the operator, the connector and the router (stdlib only): the kv_transfer_params
schema, label keys, metric names, termination-message prefixes and protocol versions. Each side imports
these instead of repeating the strings (docs/contracts.md is the prose).
"""
