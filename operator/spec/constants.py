"""The API's identity and the presets' limits that its rules and defaults use."""

GROUP = "kvferry.io"
VERSION = "v1alpha1"
KIND = "DisaggregatedInference"
PLURAL = "disaggregatedinferences"
SINGULAR = "disaggregatedinference"
SHORT_NAMES = ["dinf"]

ACCELERATORS = ("p5en", "p5", "trn2", "trn1", "cpu", "none")
EFA_ACCELERATORS = ("p5en", "p5", "trn2", "trn1")
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
MAX_NAME_LEN = 42  # `<name>-prefill` + the StatefulSet's 11-char revision hash must fit a 63-char label
