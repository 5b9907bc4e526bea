"""Tools around the product: launch vLLM (serve, pdstack), load benches, inject, the transfer demo,
host KV caches."""
