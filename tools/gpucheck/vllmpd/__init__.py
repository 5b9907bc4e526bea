"""GPU check: kvferry P/D on one CUDA device against a single vLLM, in one command, no network.

    kvferry gpu-check-vllm [--quick] [--out results.json] [--backend UCX] [--enforce-eager]
                           [--kv-buffer-devices cuda,cpu]

On a machine without a usable CUDA device (or without CUDA builds of vLLM and NIXL) it prints
`SKIP: <reason>` and exits 0 without starting anything. Otherwise it builds a random tiny model
locally (`kvferry model build`: 8 heads, 2 KV heads, head_dim 128, bfloat16) and, for every case of the matrix

    attention backend FLASH_ATTN, FLASHINFER  x  KV cache dtype auto, fp8
        x  KV buffer device (--kv-buffer-devices, default cuda)  x  blocks P16/D16, P16/D32

compares the greedy token ids of a single vLLM (no connector; started and stopped before the pair)
with those of a prefill (kv_producer) and a decode (kv_consumer) vLLM running KvferryConnector on
the same GPU, the request pair sent straight to P and D with the contract's `kvferry` params (as in
tests/e2e/test_kvferry_connector_vllm.py). Per case it prints outputs equal/total, the KV bytes and
WRITE latency from P's and D's /metrics, a burst of concurrent long-prompt pairs as GB/s, the KV
layout lines each server logged, and whether P's and D's kvferry layout line says "staged through
host memory" (a warning when that disagrees with the buffer device). The P server of a (backend,
dtype, buffer device) group serves all its cases; the single server's outputs serve every buffer
device of a (backend, dtype). Servers start one after the other (concurrent start-ups skew vLLM's
GPU memory profiling): the default matrix is 16 start-ups (4 groups of single, P, D16, D32), 28 with
cuda,cpu, --quick 3; --enforce-eager starts faster.

The KV buffer device is the kv_buffer_device of P's and D's kv-transfer-config. cuda: NIXL registers
the GPU cache itself (GPUDirect RDMA). cpu: host staging for nodes without GPUDirect RDMA: the
connector registers pinned host twins of the cache (as large as it: mind host RAM) and copies blocks
device<->host around each transfer. `--kv-buffer-devices cuda,cpu` runs every case both ways; the
case name carries it (FLASH_ATTN/kv=auto/buf=cpu/P16-D16), in the summary and the --out JSON too.

Exit status: 0 when every case passed (or SKIP), 1 when an output differed, a transfer failed or a
server did not start (its log tail is printed), 2 for bad arguments. Every server binds 127.0.0.1
and runs in its own process group, stopped by PID in `finally`. Logs stay in --workdir.
"""
