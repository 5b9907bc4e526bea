"""The spec's sections as dataclasses; field docs, defaults and bounds become the CRD schema."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.operator.spec.autoscaling import Autoscaling
from kvferry.operator.spec.compile_cache import CompileCache
from kvferry.operator.spec.constants import ACCELERATORS, BACKENDS, CONNECTORS, MODES
from kvferry.operator.spec.fields import Obj, f
from kvferry.operator.spec.model_storage import ModelStorage
from kvferry.operator.spec.placement import Placement
from kvferry.operator.spec.podinputs import ENV_ITEM_SCHEMA, IMAGE_SCHEMA, RESOURCES_SCHEMA
from kvferry.operator.spec.routing import Routing


@dataclass
class KvTransfer:
    """How KV moves from prefill to decode."""

    mode: str = f(
        "push: decode registers blocks, prefill writes into them; pull: decode reads.",
        "push",
        enum=list(MODES),
    )
    connector: str = f(
        "kvferry: the bundled KvferryConnector; vllm: upstream NixlPushConnector/NixlConnector.",
        "kvferry",
        enum=list(CONNECTORS),
    )
    backends: list[str] = f(
        "NIXL backends; empty means the preset's (LIBFABRIC on EFA presets, UCX on cpu).",
        [],
        maxItems=2,
        items={"enum": list(BACKENDS)},
    )
    buffer_device: str = f(
        "Where KV is staged for transfer: auto (preset), device (accelerator memory, GPUDirect RDMA), "
        "cpu (host copies of the KV: nodes without GPUDirect RDMA).",
        "auto",
        enum=["auto", "device", "cpu"],
    )
    lease_seconds: int = f(
        "How long prefill holds transferred KV for decode before freeing it.", 30, minimum=1, maximum=3600
    )
    deadline_seconds: int = f(
        "How long decode waits for KV before reporting the load failed.", 30, minimum=1, maximum=3600
    )
    load_failure_policy: str = f(
        "What decode does when KV never arrives: fail the request or recompute.",
        "fail",
        enum=["fail", "recompute"],
    )
    side_channel_port: int = f(
        "NIXL side-channel port on every engine pod.", 5600, minimum=1024, maximum=65535
    )
    connector_source: str = f(
        "Where the kvferry connector comes from. image: the vLLM image has it installed (kvferry's vLLM "
        "image). inject: an init container copies it from the operator image into a stock vLLM image "
        "(on PYTHONPATH), and a start-up preflight refuses a vLLM or NIXL the connector cannot use.",
        "image",
        enum=["image", "inject"],
    )


@dataclass
class Engine:
    """vLLM settings both roles must share (they feed the revision hash)."""

    block_size: int | None = f(
        "KV block size in tokens, same on prefill and decode. Unset: the preset's (16; 128 on cpu, "
        "whose attention kernels need a multiple of 32).",
        None,
        enum=[8, 16, 32, 64, 128, 256],
    )
    max_model_len: int | None = f(
        "Maximum context length; unset lets vLLM derive it from the model.", None, minimum=1, maximum=2**27
    )
    dtype: str = f("Model weight dtype.", "auto", enum=["auto", "bfloat16", "float16", "float32"])
    enable_prefix_caching: bool = f(
        "Prefix caching on both roles: a prefill hit skips compute; decode registers, and prefill "
        "pushes, only the blocks decode does not hold.",
        True,
    )
    extra_args: list[str] = f("Extra vLLM args for both roles.", [], maxItems=64, items={"maxLength": 4096})


@dataclass
class Role:
    """One engine role (prefill or decode): a StatefulSet of vLLM pods."""

    replicas: int = f("Number of engine pods.", 1, minimum=1, maximum=1000)
    replicas_owner: str = f(
        "spec: the operator applies `replicas`. autoscaler: an HPA targets the "
        "StatefulSet and the operator never writes replicas after creation.",
        "spec",
        enum=["spec", "autoscaler"],
    )
    accelerator: str | None = f(
        "This role's hardware preset when it differs from spec.accelerator (e.g. prefill on p5en, "
        "decode on p5); only presets whose KV layouts the kvferry connector maps: p5en with p5. "
        "Unset: spec.accelerator.",
        None,
        enum=list(ACCELERATORS),
    )
    tensor_parallel_size: int = f(
        "Tensor-parallel size per engine (accelerators, or NeuronCores on Trainium). Beyond one node "
        "(decode only, p5en/p5/trn2): whole nodes, one pod each, as a LeaderWorkerSet group per replica.",
        1,
        minimum=1,
        maximum=512,
    )
    extra_args: list[str] = f(
        "Extra vLLM args for this role only.", [], maxItems=64, items={"maxLength": 4096}
    )
    env: list[Obj] = f(
        "Extra container env (Kubernetes EnvVar); wins over preset env by name. The engine's identity "
        "(POD_NAME, POD_NAMESPACE, POD_IP, VLLM_NIXL_SIDE_CHANNEL_HOST/PORT) is the operator's.",
        [],
        maxItems=128,
        items=ENV_ITEM_SCHEMA,
    )
    resources: Obj = f(
        "Container resources (limits, requests: bounded quantities); keys here win over the preset's.",
        {},
        **RESOURCES_SCHEMA,
    )
    node_selector: dict[str, str] = f("Extra node selector, merged over the preset's.", {})
    tolerations: list[Obj] = f("Extra tolerations, added to the preset's.", [], maxItems=32)
    affinity: Obj = f("Pod affinity (Kubernetes Affinity), used as given.", {})
    efa: int | None = f(
        "EFA devices per pod; unset derives it from the preset and TP size.", None, minimum=0, maximum=32
    )
    efa_attach: str = f(
        "How this role's pods get their GPUs and EFA devices. devicePlugin: the extended resources "
        "nvidia.com/gpu and vpc.amazonaws.com/efa (NVIDIA and EFA device plugins). dra: one "
        "ResourceClaim per pod (Dynamic Resource Allocation, Kubernetes >= 1.34) from the NVIDIA GPU DRA "
        "driver's class gpu.nvidia.com and the EFA DRA driver's class efa.networking.k8s.aws, each GPU's "
        "EFA devices on its PCIe root (resource.kubernetes.io/pcieRoot); GPU presets (p5en, p5) only. "
        "Which one a cluster's nodes use cannot be known offline: `kvferry doctor` tells "
        "(docs/eks-dra.md).",
        "devicePlugin",
        enum=["devicePlugin", "dra"],
    )
    startup_seconds: int | None = f(
        "Startup-probe budget for model load; unset uses the preset's.", None, minimum=30, maximum=21600
    )
    shutdown_timeout_seconds: int | None = f(
        "vLLM --shutdown-timeout drain; unset: lease + 30 s on prefill, 60 s on decode.",
        None,
        minimum=0,
        maximum=3600,
    )
    scheduler_name: str | None = f(
        "Scheduler for this role's pods (pod schedulerName). Unset: the preset's; the Neuron presets "
        "(trn2, trn1) name my-scheduler, the scheduler the Neuron Helm chart deploys with the Neuron "
        "scheduler extension, which places multi-device pods on directly connected devices "
        "(docs/trainium.md); others use the cluster's default scheduler.",
        None,
        minLength=1,
        maxLength=253,
    )
    image_pull_secrets: list[str] = f(
        "Names of Secrets (type kubernetes.io/dockerconfigjson, in the CR's namespace) the kubelet uses "
        "to pull this role's engine image from a private registry.",
        [],
        maxItems=16,
        items={"minLength": 1, "maxLength": 253},
    )


@dataclass
class SecretKeyRef:
    """A key of a Secret in the CR's namespace. Only the reference is stored; pods read the value."""

    name: str = f("Secret name.", minLength=1, maxLength=253)
    key: str = f("Key inside the Secret.", minLength=1, maxLength=253)


@dataclass
class ModelToken:
    """A model-download token (e.g. Hugging Face) that engine pods get as an env var from a Secret."""

    name: str = f("Secret name.", minLength=1, maxLength=253)
    key: str = f("Key inside the Secret.", "token", minLength=1, maxLength=253)
    env: str = f("Env var the engines read it from.", "HF_TOKEN", minLength=1, maxLength=253)


@dataclass
class NetworkPolicy:
    """NetworkPolicies isolating this service: engines talk only to each other, the router and metrics
    readers; clients reach only the router. Needs a CNI that enforces NetworkPolicy (docs/security.md)."""

    enabled: bool = f("Render the NetworkPolicies.", True)
    clients: list[Obj] = f(
        "NetworkPolicyPeers allowed to call the router; empty = any source (use router.apiKeySecret).",
        [],
        maxItems=32,
    )
    metrics_readers: list[Obj] = f(
        "NetworkPolicyPeers allowed to read engine /metrics (port http); empty = the kvferry operator's "
        "pods (labels app.kubernetes.io/name=kvferry, app.kubernetes.io/component=operator) in any "
        "namespace.",
        [],
        maxItems=32,
    )


@dataclass
class Router:
    """The OpenAI-compatible router in front of both roles."""

    replicas: int = f("Router pods.", 1, minimum=1, maximum=100)
    policy: str = f(
        "How the router picks a decode pod.", "least-loaded", enum=["least-loaded", "round-robin"]
    )
    image: str | None = f(
        "Router image (tag and/or @sha256: digest); unset uses the operator's own image.",
        None,
        **IMAGE_SCHEMA,
    )
    service_type: str = f(
        "Type of the client-facing Service.", "ClusterIP", enum=["ClusterIP", "NodePort", "LoadBalancer"]
    )
    resources: Obj = f(
        "Router container resources (limits, requests: bounded quantities).", {}, **RESOURCES_SCHEMA
    )
    api_key_secret: SecretKeyRef | None = f(
        "Secret holding the API key clients must send (Authorization: Bearer); unset = no key. "
        "Passed to the router as an env var from the Secret, never written into any object.",
        None,
    )
    routing: Routing = f("Prefix-aware engine choice and selective disaggregation.", Routing())


@dataclass
class Spec:
    """Desired state of a disaggregated prefill/decode vLLM service."""

    model: str = f(
        "The model: hf://ORG/NAME or a bare hub id (downloaded into modelStorage.cache), "
        "pvc://CLAIM/PATH (files on a ReadOnlyMany claim, mounted read-only), s3://BUCKET/PREFIX "
        "(streamed by vLLM's Run:ai model streamer with the pods' service account's credentials), or "
        "/PATH inside the image (docs/models.md).",
        minLength=1,
        maxLength=4096,
    )
    served_model_name: str | None = f("Name clients use; unset uses `model`.", None)
    image: str | None = f(
        "vLLM image for both roles; unset uses the preset's. A digest (`repo@sha256:...`, with or "
        "without a tag) pins the code: a re-pushed tag changes it under the same revision.",
        None,
        **IMAGE_SCHEMA,
    )
    accelerator: str = f(
        "Hardware preset: p5en, p5, trn2, trn1, cpu, or none (set everything yourself).",
        "cpu",
        enum=list(ACCELERATORS),
    )
    kv_transfer: KvTransfer = f("KV transfer between the roles.", KvTransfer())
    vllm: Engine = f("vLLM settings shared by both roles.", Engine())
    prefill: Role = f("Prefill role.", Role())
    decode: Role = f("Decode role.", Role())
    router: Router = f("Router.", Router())
    model_token: ModelToken | None = f(
        "Secret with a model-download token for the engines; unset = none.", None
    )
    network_policy: NetworkPolicy = f("Network isolation of the service.", NetworkPolicy())
    placement: Placement = f(
        'Where prefill and decode pods land relative to each other (docs/install.md "Placement").',
        Placement(),
    )
    autoscaling: Autoscaling | None = f(
        "Scale prefill and decode to latency targets (docs/autoscaling.md); unset = replicas as given.", None
    )
    model_storage: ModelStorage | None = f(
        "Where the model's files are kept and how large they are (docs/models.md); unset: a hub model "
        "downloads into an emptyDir (needs size on the p5en, p5, trn2 and trn1 presets).",
        None,
    )
    compile_cache: CompileCache | None = f(
        "Neuron presets (trn2, trn1): where compiled graphs persist across restarts (docs/trainium.md "
        '"Compile cache"). Unset: a hostPath on the node under /var/lib/kvferry/neuron-cache. '
        "Other presets ignore it.",
        None,
    )

    def role_accelerator(self, role: str) -> str:
        """The preset `role` (prefill/decode) runs on: its own, else the service's."""
        own: str | None = getattr(self, role).accelerator
        return own or self.accelerator
