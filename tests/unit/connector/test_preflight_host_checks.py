"""The start-up preflight reads what EFA needs from the host: memory locking (`ulimit -l`, CapEff) and,
in a multi-node group, which NCCL net plugin would load. Each case names the documented fact it follows
(docs/eks.md, "Memory locking" and "NCCL between nodes")."""

from __future__ import annotations

import resource
from pathlib import Path

from kvferry.connector.metrics import Metrics
from kvferry.connector.preflight import efa_checks, memlock_check, nccl_net_checks, record
from kvferry.contracts.metrics import CHECK_MEMLOCK, CHECK_NCCL_NET
from kvferry.operator.status import remedies
from kvferry.operator.status.conditions import Reason
from prometheus_client import generate_latest

EIGHT_MIB = (8 * 1024 * 1024, 8 * 1024 * 1024)
CAP_EFF_NON_ROOT = "CapEff:\t0000000000000000\n"  # uid 1000 + IPC_LOCK (nvidia-container-toolkit #2037)
CAP_EFF_ROOT_IPC_LOCK = "CapEff:\t00000000a80445fb\n"  # runtime default set plus bit 14 (CAP_IPC_LOCK)


def _status(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "status"
    path.write_text("Name:\tvllm\n" + text)
    return path


def test_non_root_with_ipc_lock_and_8_mib_fails_with_the_remedy(tmp_path: Path) -> None:
    # Fact: an added IPC_LOCK is inert for a non-root UID: CapEff 0, `ulimit -l` 8192 KB (issue 2037).
    check = memlock_check(EIGHT_MIB, _status(tmp_path, CAP_EFF_NON_ROOT))
    assert check.name == CHECK_MEMLOCK and not check.ok
    assert "ulimit -l 8192 KiB" in check.detail and "IPC_LOCK not effective" in check.detail
    assert "LimitMEMLOCK=infinity" in check.detail and "UID 0 with IPC_LOCK" in check.detail


def test_root_with_ipc_lock_passes_at_any_limit(tmp_path: Path) -> None:
    # Fact: CAP_IPC_LOCK (bit 14) in the effective set lifts RLIMIT_MEMLOCK (capabilities(7)).
    check = memlock_check(EIGHT_MIB, _status(tmp_path, CAP_EFF_ROOT_IPC_LOCK))
    assert check.ok and "IPC_LOCK effective" in check.detail


def test_unlimited_memlock_passes_without_the_capability(tmp_path: Path) -> None:
    # Fact: the EFA installer's own limits.d sets memlock unlimited; LimitMEMLOCK=infinity is its twin.
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    assert memlock_check(unlimited, _status(tmp_path, CAP_EFF_NON_ROOT)).ok


def test_single_node_pods_get_no_nccl_check() -> None:
    assert nccl_net_checks(["rdmap0"], {"LD_LIBRARY_PATH": ""}) == []
    assert nccl_net_checks(["rdmap0"], {"LWS_GROUP_SIZE": "1"}) == []


def test_multi_node_without_the_ofi_plugin_falls_back_to_sockets(tmp_path: Path) -> None:
    # Fact: without libnccl-net(-ofi).so on the library path NCCL uses NET/Socket (NeMo-RL PR 2359).
    env = {"LWS_GROUP_SIZE": "2", "NCCL_NET_PLUGIN": "ofi", "LD_LIBRARY_PATH": str(tmp_path)}
    (check,) = nccl_net_checks(["rdmap0"], env)
    assert check.name == CHECK_NCCL_NET and not check.ok
    assert "libnccl-net-ofi.so not on LD_LIBRARY_PATH" in check.detail and "NET/Socket" in check.detail


def test_multi_node_with_the_plugin_and_efa_reports_net_ofi(tmp_path: Path) -> None:
    # Fact: NCCL_NET_PLUGIN=X loads libnccl-net-X.so (NCCL ext-net); aws-ofi-nccl ships libnccl-net-ofi.so.
    (tmp_path / "libnccl-net-ofi.so").write_bytes(b"")
    env = {"LWS_GROUP_SIZE": "2", "NCCL_NET_PLUGIN": "ofi", "LD_LIBRARY_PATH": f"/nowhere:{tmp_path}"}
    (check,) = nccl_net_checks(["rdmap0", "rdmap1"], env)
    assert check.ok and check.detail.startswith(f"NET/OFI from {tmp_path}/libnccl-net-ofi.so")
    assert "provider efa over 2 EFA devices" in check.detail
    (no_efa,) = nccl_net_checks([], env)
    assert not no_efa.ok and "no EFA device" in no_efa.detail


def test_libfabric_reports_memlock_and_ucx_does_not(tmp_path: Path) -> None:
    names = [c.name for c in efa_checks(["LIBFABRIC"], tmp_path)]
    assert names[:2] == ["efa_device", CHECK_MEMLOCK]
    assert CHECK_MEMLOCK not in [c.name for c in efa_checks(["UCX"], tmp_path)]


def test_failed_memlock_is_a_metric_and_a_condition_remedy(tmp_path: Path) -> None:
    metrics = Metrics()
    record([memlock_check(EIGHT_MIB, _status(tmp_path, CAP_EFF_NON_ROOT))], metrics)
    text = generate_latest(metrics.registry).decode()
    assert f'kvferry_preflight_ok{{check="{CHECK_MEMLOCK}"}} 0.0' in text
    # The operator's TransferHealthy message names the failed checks by role (status/transfer.py).
    msg = remedies.explain(Reason.PREFLIGHT_FAILED, f"start-up checks failed (prefill {CHECK_MEMLOCK})")
    assert "memlock: run the engine as UID 0 with IPC_LOCK" in msg and "nccl_net:" not in msg
    msg = remedies.explain(Reason.PREFLIGHT_FAILED, f"start-up checks failed (decode {CHECK_NCCL_NET})")
    assert "aws-ofi-nccl" in msg
