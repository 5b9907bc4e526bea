"""Tools around the product: launch vLLM (serve, pdstack), load benches, the transfer demo, host KV
caches, the GPU check."""
