"""GPU check of kvferry's own CUDA path with torch and NIXL only (no vLLM): `kvferry gpu-check`.

KV caches are allocated on the device in the page layouts vLLM's CUDA backends use (pages.py),
written through a torch form of their scatter, measured by the connector (kvcache.probe_offsets),
and moved between processes by the connector's endpoint, mapping, transport and staging (ranks.py);
run.py drives the cases and prints one line each. docs/verification.md says how to run it on a GPU.
"""
