"""The API's identity and the presets' limits that its rules and defaults use."""

GROUP = "kvferry.io"
VERSION = "v1alpha1"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["dinf"]

ACCELERATORS = ("p5en", "p5", "trn2", "trn1", "cpu", "none")
EFA_ACCELERATORS = ("p5en", "p5", "trn2", "trn1")
# Presets whose roles may take GPUs and EFA through DRA claims (spec.<role>.efaAttach dra, render/dra.py):
# NVIDIA GPUs aligned with EFA by PCIe root. Neuron-EFA alignment is not rendered.
DRA_ACCELERATORS = ("p5en", "p5")
# Largest tensor-parallel group one pod can hold (one node): GPUs, or NeuronCores at the default LNC.
MAX_TP = {"p5en": 8, "p5": 8, "trn2": 64, "trn1": 32, "cpu": 64, "none": 64}
# Presets whose roles may span nodes: one pod per node, leader + workers per replica (LeaderWorkerSet),
# tensorParallelSize a whole multiple of MAX_TP, at most MAX_GROUP_NODES nodes per replica.
MULTI_NODE_ACCELERATORS = ("p5en", "p5", "trn2")
MAX_GROUP_NODES = 8
# Presets one role may swap for another (spec.<role>.accelerator): same GPU vendor and CUDA vLLM image,
# NIXL over LIBFABRIC on EFA, GPUDirect buffers, one node's TP limit; the kvferry connector maps the
# KV layouts between them (block sizes, TP). Any other mix has no layout the connector can map or no
# NIXL backend both ends share (cpu: UCX; Neuron and CUDA caches differ), and is refused.
ACCELERATOR_FAMILIES = (("p5en", "p5"),)
MODES = ("push", "pull")
CONNECTORS = ("kvferry", "vllm")
BACKENDS = ("LIBFABRIC", "UCX")
# Presets on AWS Neuron (Trainium). The kvferry connector measures each layer's KV layout through the
# attention backend's own KV write (`impl.do_kv_cache_update`, connector/kvcache.py), which vLLM's
# Neuron backend does not have, and the Neuron DLC images ship vLLM < 0.32 (connector/compat.py): on
# these presets only the upstream NixlConnector in read (pull) mode runs, as Neuron documents it.
NEURON_ACCELERATORS = ("trn2", "trn1")
# KV heads of models the spec knows (each model's config.json, `num_key_value_heads`; BLOOM has no GQA,
# so its `n_head`). The kvferry connector splits whole KV heads over TP ranks and refuses replicated or
# uneven splits (connector/layout.py split_heads): for these models the API server refuses such TP
# sizes; any other model is refused by the connector when the engine starts.
KNOWN_KV_HEADS = {
    "Qwen/Qwen3-32B": 8,
    "Qwen/Qwen3-8B": 8,
    "meta-llama/Llama-3.1-8B-Instruct": 8,
    "meta-llama/Llama-3.2-1B-Instruct": 8,
    "meta-llama/Llama-3.3-70B-Instruct": 8,
    "bigscience/bloom": 112,
}
MAX_NAME_LEN = 42  # `<name>-prefill` + the StatefulSet's 11-char revision hash must fit a 63-char label
