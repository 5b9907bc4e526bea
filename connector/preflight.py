"""Preflight step: can this host move KV the way the config asks (NIXL, backend plugins, EFA)?

`kvferry preflight [--backends UCX]` prints one line per check and exits non-zero if any fails.
The same checks run at connector start-up and set `kvferry_preflight_ok{check=...}`, so a pod that
would silently fall back to TCP (UCX on EFA, LIBFABRIC without an EFA device) is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from kvferry.connector.config import ConfigError, KvferryConfig
from kvferry.connector.metrics import Metrics
from kvferry.contracts import termination
from kvferry.contracts.metrics import CHECK_BACKEND, CHECK_MEMLOCK, CHECK_NCCL_NET, CHECK_UCX_ON_EFA

SYS_INFINIBAND = Path("/sys/class/infiniband")
PROC_STATUS = Path("/proc/self/status")
CAP_IPC_LOCK = 14  # linux/capability.h: lets a process lock (and RDMA-register) memory past RLIMIT_MEMLOCK


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def efa_devices(root: Path = SYS_INFINIBAND) -> list[str]:
    """RDMA devices bound to the efa driver."""
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if (d / "device" / "driver").resolve().name == "efa")


def run_checks(cfg: KvferryConfig, efa_root: Path = SYS_INFINIBAND) -> list[Check]:
    checks: list[Check] = []
    try:
        import nixl._api as api

        checks.append(Check("nixl_import", True, f"nixl._api from {Path(api.__file__).parent.name}"))
    except Exception as exc:  # ImportError, or a CUDA library error from the wrong nixl wheel
        return [Check("nixl_import", False, f"import nixl._api failed: {exc}")]
    return checks + _backend_checks(api, cfg.backends) + efa_checks(cfg.backends, efa_root)


def efa_checks(backends: list[str], efa_root: Path = SYS_INFINIBAND) -> list[Check]:
    """Does the backend choice fit the host's EFA devices? (LIBFABRIC needs one; UCX wastes them.)

    With LIBFABRIC the host checks follow (memory locking; NCCL's net plugin in a multi-node group),
    so every caller of this function (the CLI, the connector's start-up) reports them too.
    """
    efa = efa_devices(efa_root)
    if "LIBFABRIC" in backends:
        detail = f"EFA devices {efa}" if efa else "no EFA device: LIBFABRIC would use a TCP/shm provider"
        return [Check("efa_device", bool(efa), detail), memlock_check(), *nccl_net_checks(efa)]
    if efa:
        why = (
            f"EFA devices {efa} present but backends={backends}: UCX falls back to TCP on EFA; use LIBFABRIC"
        )
        return [Check(CHECK_UCX_ON_EFA, False, why)]
    return []


def memlock_check(limits: tuple[int, int] | None = None, status: Path = PROC_STATUS) -> Check:
    """Can libfabric's EFA provider lock the memory it registers? `ulimit -l` and CapEff decide.

    The EFA installer sets memlock to unlimited (its limits.d file), which never reaches a container:
    there the limit is the runtime's (containerd LimitMEMLOCK), and CAP_IPC_LOCK in the effective set
    (IPC_LOCK added *and* UID 0: nvidia-container-toolkit issue 2037) is what lifts it.
    """
    soft, _hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cap_eff = _cap_eff(status)
    has_cap = cap_eff is not None and bool(cap_eff >> CAP_IPC_LOCK & 1)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    caps = "unknown" if cap_eff is None else f"{cap_eff:#x}"
    detail = f"ulimit -l {shown}, CapEff {caps} (IPC_LOCK {'effective' if has_cap else 'not effective'})"
    if soft == resource.RLIM_INFINITY or has_cap:
        return Check(CHECK_MEMLOCK, True, detail)
    return Check(
        CHECK_MEMLOCK,
        False,
        f"{detail}: EFA memory registration fails past this limit; run the engine as UID 0 with "
        "IPC_LOCK (the EFA presets do) or set LimitMEMLOCK=infinity for containerd on the node "
        "(docs/eks.md, memory locking)",
    )


def _cap_eff(status: Path) -> int | None:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    return None


def nccl_net_checks(efa: list[str], env: dict[str, str] | None = None) -> list[Check]:
    """Which NCCL net plugin would load in a multi-node group (LWS sets LWS_GROUP_SIZE)?

    Within one node NCCL uses NVLink and needs no net plugin, so single-node pods get no check. NCCL
    loads `libnccl-net-$NCCL_NET_PLUGIN.so` (or the path it names; unset: `libnccl-net.so`) from the
    library path; without it, or without an EFA device for aws-ofi-nccl's efa provider, it falls
    back to NET/Socket over the ENA interface.
    """
    env = dict(os.environ) if env is None else env
    try:
        nodes = int(env.get("LWS_GROUP_SIZE", "1"))
    except ValueError:
        nodes = 1
    if nodes <= 1:
        return []
    name = env.get("NCCL_NET_PLUGIN", "")
    if name == "none":
        return [Check(CHECK_NCCL_NET, False, "NCCL_NET_PLUGIN=none: NET/Socket between the group's nodes")]
    library = name if "/" in name else f"libnccl-net-{name}.so" if name else "libnccl-net.so"
    found = _find_library(library, env.get("LD_LIBRARY_PATH", ""))
    if found is None:
        return [
            Check(
                CHECK_NCCL_NET,
                False,
                f"{library} not on LD_LIBRARY_PATH: NCCL would use NET/Socket between the {nodes} nodes "
                "(the engine image must carry aws-ofi-nccl, images/vllm/Dockerfile)",
            )
        ]
    if not efa:
        why = f"{found} present but no EFA device: NET/OFI has no efa provider"
        return [Check(CHECK_NCCL_NET, False, why)]
    return [Check(CHECK_NCCL_NET, True, f"NET/OFI from {found}, provider efa over {len(efa)} EFA devices")]


def _find_library(library: str, search: str) -> str | None:
    if "/" in library:
        return library if Path(library).is_file() else None
    for folder in filter(None, search.split(":")):
        candidate = Path(folder) / library
        if candidate.is_file():
            return str(candidate)
    return None


def backend_checks(created: list[str], wanted: list[str]) -> list[Check]:
    """One check per wanted backend: did the NIXL agent create it?"""
    return [
        Check(CHECK_BACKEND + b, b in created, f"plugin {b} {'loaded' if b in created else 'not created'}")
        for b in wanted
    ]


def _backend_checks(api, backends: list[str]) -> list[Check]:
    cfg = api.nixl_agent_config(
        enable_prog_thread=False,
        enable_listen_thread=False,
        capture_telemetry=False,
        num_threads=0,
        backends=[],
    )
    try:
        agent = api.nixl_agent(f"kvferry-preflight-{os.getpid()}", cfg)
    except Exception as exc:
        return [Check("nixl_agent", False, f"creating a NIXL agent failed: {exc}")]
    plugins = agent.get_plugin_list()
    out = []
    for backend in backends:
        if backend not in plugins:
            out.append(Check(CHECK_BACKEND + backend, False, f"plugin {backend} not found (have {plugins})"))
            continue
        try:
            agent.create_backend(backend, {})
            out.append(Check(CHECK_BACKEND + backend, True, f"plugin {backend} loaded"))
        except Exception as exc:
            out.append(Check(CHECK_BACKEND + backend, False, f"plugin {backend} failed to start: {exc}"))
    return out


def record(checks: list[Check], metrics: Metrics) -> None:
    """Export the checks as kvferry_preflight_ok{check=...} (the operator reads them: TransferHealthy)."""
    for c in checks:
        metrics.record("preflight", 1 if c.ok else 0, c.name)


TERMINATION_LOG = Path("/dev/termination-log")


def failure_message(checks: list[Check], limit: int = termination.MAX_CHARS) -> str:
    """One line naming every failed check, with the prefix the operator recognises (podchecks.py)."""
    failed = "; ".join(f"{c.name}: {c.detail}" for c in checks if not c.ok)
    return (termination.PREFLIGHT_FAILED + failed)[:limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", help="NIXL backends (default: the config's, LIBFABRIC)")
    parser.add_argument("--extra-config", default="{}", help="kv_connector_extra_config JSON")
    parser.add_argument(
        "--startup",
        action="store_true",
        help="pod start-up mode: also check the vLLM and NIXL versions and that the connector's vLLM "
        "glue imports (connector/compat.py)",
    )
    parser.add_argument(
        "--termination-log",
        type=Path,
        default=None,
        help=f"on failure write the failed checks here (in a pod: {TERMINATION_LOG})",
    )
    args = parser.parse_args(argv)
    try:
        extra = json.loads(args.extra_config)
        if args.backends:
            extra["backends"] = args.backends
        cfg = KvferryConfig.from_extra(extra)
    except (ConfigError, json.JSONDecodeError) as exc:
        print(f"preflight: bad configuration: {exc}")
        return 2
    checks = []
    if args.startup:
        from kvferry.connector.compat import startup_checks

        checks += startup_checks()
    checks += run_checks(cfg)
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<18} {c.detail}")
    ok = all(c.ok for c in checks)
    print("preflight passed" if ok else "preflight FAILED")
    if not ok and args.termination_log:
        args.termination_log.write_text(failure_message(checks))
    return 0 if ok else 1


if __name__ == "__main__":  # `python -m kvferry.connector.preflight`: the pod's start-up step
    import sys

    code = main()
    sys.stdout.flush()
    # Exit without interpreter teardown: after importing vLLM and creating a NIXL agent, teardown can
    # wait on library threads, and the vLLM server must start right after this step.
    os._exit(code)
