"""`kvferry inject --to DIR`: copy the pure-Python connector into a directory a stock vLLM image imports.

The operator runs this as an init container from its own image (`kvferry.connectorSource: inject`) into
an emptyDir that the vLLM container gets on PYTHONPATH, so users need not rebuild their vLLM image.
Copied: the `kvferry.connector` and `kvferry.contracts` packages (namespace portions: no
`kvferry/__init__.py`; nothing else of kvferry runs inside vLLM), their .py files only: compiled files
would tie the copy to the operator image's Python ABI. Everything they import besides comes from the
vLLM image: NIXL, numpy, prometheus_client, vLLM, and msgspec (a vLLM dependency; the wire format uses
it); `kvferry preflight --startup` checks them when the pod starts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
from pathlib import Path

from kvferry.contracts import termination

# (import name, where it lands under DIR). The connector keeps its dotted path so
# `kv_connector_module_path: kvferry.connector` resolves unchanged.
PACKAGES = (
    ("kvferry.connector", Path("kvferry/connector")),
    ("kvferry.contracts", Path("kvferry/contracts")),
)
MANIFEST = "kvferry-inject.json"
TERMINATION_LOG = Path("/dev/termination-log")


class InjectError(RuntimeError):
    """The copy could not be made (source package missing, destination not writable)."""


def package_dir(module: str) -> Path:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise InjectError(f"{module} is not installed in this image: {exc}") from exc
    if not getattr(mod, "__file__", None):
        raise InjectError(f"{module} is a namespace package; cannot locate its files")
    return Path(mod.__file__).parent


def python_files(src: Path) -> list[Path]:
    """Source files of a package, relative to it: .py only (no bytecode, no compiled extensions)."""
    return sorted(p.relative_to(src) for p in src.rglob("*.py") if "__pycache__" not in p.parts)


def inject(dest: Path) -> dict[str, int]:
    """Copy every package in PACKAGES under `dest`; returns files copied per package."""
    counts: dict[str, int] = {}
    for module, rel in PACKAGES:
        src = package_dir(module)
        target = dest / rel
        if target.exists():
            shutil.rmtree(target)  # a restarted init container starts from a clean copy
        files = python_files(src)
        for f in files:
            (target / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f, target / f)
        counts[module] = len(files)
    from importlib.metadata import PackageNotFoundError, version

    try:
        kvferry_version = version("kvferry")
    except PackageNotFoundError:
        kvferry_version = "unknown"
    manifest = {"kvferry": kvferry_version, "files": counts}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry inject", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--to", required=True, type=Path, help="directory the vLLM container puts on PYTHONPATH"
    )
    parser.add_argument(
        "--termination-log",
        type=Path,
        default=None,
        help=f"on failure also write the reason here (in a pod: {TERMINATION_LOG})",
    )
    args = parser.parse_args(argv)
    try:
        args.to.mkdir(parents=True, exist_ok=True)
        counts = inject(args.to)
    except (InjectError, OSError) as exc:
        message = f"{termination.INJECT_FAILED}{exc}"
        print(message)
        if args.termination_log:
            args.termination_log.write_text(message[: termination.MAX_CHARS])
        return 1
    for module, n in counts.items():
        print(f"copied {module} ({n} files) to {args.to}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
