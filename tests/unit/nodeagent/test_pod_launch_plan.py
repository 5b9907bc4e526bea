"""A pod spec becomes the command line, environment and paths a kubelet would give its container."""

from __future__ import annotations

import pytest
from kvferry.local.nodeagent import alloc, podspec


def _pod(container: dict, **spec) -> dict:
    return {
        "metadata": {
            "name": "tiny-prefill-0",
            "namespace": "ns",
            "uid": "u-1",
            "labels": {"role": "prefill"},
        },
        "spec": {"nodeName": "cpu-0", "containers": [container], **spec},
    }


CTX = podspec.PodContext(
    pod_ip="10.213.0.2",
    host_ip="10.213.0.1",
    apiserver_host="127.0.0.1",
    apiserver_port=6443,
    volume_dirs={"config": "/tmp/pod/volumes/config", "shm": None},
)


def _no_lookup(kind: str, ns: str, name: str) -> dict[str, str] | None:
    return None


def test_field_refs_and_var_expansion_resolve_in_order() -> None:
    container = {
        "name": "vllm",
        "command": ["kvferry", "serve"],
        "args": ["--host", "$(POD_IP)", "--engine-id=$(POD_NAME)", "$$(literal)", "$(UNSET)"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
            {"name": "URL", "value": "http://$(POD_IP):8000"},
        ],
    }
    plan = podspec.plan_container(_pod(container), container, CTX, _no_lookup)
    assert plan.argv == [
        "kvferry",
        "serve",
        "--host",
        "10.213.0.2",
        "--engine-id=tiny-prefill-0",
        "$(literal)",
        "$(UNSET)",
    ]
    assert plan.env["URL"] == "http://10.213.0.2:8000"
    assert plan.env["ROLE"] == "prefill"
    assert plan.env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert plan.env["HOSTNAME"] == "tiny-prefill-0"


def test_mount_paths_in_args_are_mapped_to_local_volume_dirs() -> None:
    container = {
        "name": "router",
        "command": ["kvferry", "router", "--config", "/etc/kvferry/router.yaml", "--x=/etc/kvferry/a"],
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/kvferry"},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    plan = podspec.plan_container(_pod(container), container, CTX, _no_lookup)
    assert plan.argv[3] == "/tmp/pod/volumes/config/router.yaml"
    # A mount at /tmp must not rewrite the already-mapped path again.
    pairs = [("/etc/kvferry", "/tmp/pod/volumes/config"), ("/tmp", "/tmp/pod/volumes/tmp")]
    assert podspec.map_paths("/etc/kvferry/router.yaml", pairs) == "/tmp/pod/volumes/config/router.yaml"
    assert podspec.map_paths("--dir=/tmp/x", pairs) == "--dir=/tmp/pod/volumes/tmp/x"
    assert plan.argv[4] == "--x=/tmp/pod/volumes/config/a"


def test_agent_provided_env_keeps_host_paths_under_a_tmp_mount() -> None:
    container = {
        "name": "router",
        "command": ["kvferry"],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    ctx = podspec.PodContext(**{**CTX.__dict__, "volume_dirs": {"tmp": "/tmp/pod/volumes/tmp"},
                                "extra_env": {"KUBECONFIG": "/tmp/pod/volumes/sa/kubeconfig"}})  # fmt: skip
    plan = podspec.plan_container(_pod(container), container, ctx, _no_lookup)
    assert plan.env["KUBECONFIG"] == "/tmp/pod/volumes/sa/kubeconfig"


def test_container_without_command_is_refused_naming_the_image() -> None:
    container = {"name": "vllm", "image": "vllm/vllm-openai:latest"}
    with pytest.raises(podspec.PodSpecError, match="no `command`.*vllm/vllm-openai"):
        podspec.plan_container(_pod(container), container, CTX, _no_lookup)


def test_missing_config_map_key_names_the_pod_and_key() -> None:
    container = {
        "name": "c",
        "command": ["true"],
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}],
    }
    with pytest.raises(podspec.PodSpecError, match="tiny-prefill-0.*cm has no key 'k'"):
        podspec.plan_container(_pod(container), container, CTX, _no_lookup)


def test_whole_cpu_containers_get_distinct_cores_and_the_omp_bind() -> None:
    pool = alloc.CorePool([0, 1])
    one = {"resources": {"requests": {"cpu": "1"}}}
    first, second, third = pool.take(alloc.whole_cpus(one)), pool.take(1), pool.take(1)
    assert (first, second, third) == ([0], [1], [])
    assert alloc.core_env(first, one) == {"KVFERRY_CPUSET": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert alloc.whole_cpus({"resources": {"requests": {"cpu": "500m"}}}) == 0
    pool.give_back(first)
    assert pool.take(1) == [0]
    capped = alloc.CorePool([0, 1], max_per_container=1)
    assert capped.take(2) == [0] and capped.take(2) == [1]  # a cpu: "2" request leaves a core for the peer


def test_loopback_pod_subnet_is_refused_because_endpointslices_reject_it() -> None:
    with pytest.raises(ValueError, match="not loopback"):
        alloc.AddressPool("127.0.10.0/24")
    pool = alloc.AddressPool("10.213.0.0/29")
    assert pool.node_ip == "10.213.0.1"
    assert pool.take() == "10.213.0.2"
