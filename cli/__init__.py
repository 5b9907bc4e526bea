"""`kvferry` command line: a table of subcommands, each imported only when it runs.

Lazy imports keep `kvferry router` usable in an image without kopf and `kvferry render` usable
without vLLM, NIXL or torch; a command whose package an image leaves out (images/prune.py) says so.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("kvferry.local.demo", "main", "full stack on this machine: control plane, operator, vLLM P/D"),
    "transfer-demo": ("kvferry.tools.transfer_demo", "main", "two-process push transfer over real NIXL"),
    "gpu-check": ("kvferry.tools.gpucheck.run", "main", "the connector's CUDA path on one GPU, no vLLM"),
    "gpu-check-vllm": (
        "kvferry.tools.gpucheck.vllmpd.cli",
        "main",
        "kvferry P/D through real CUDA vLLM servers on one GPU against a single vLLM",
    ),
    "router": ("kvferry.router.cli", "main", "OpenAI-compatible P/D router"),
    "bench": ("kvferry.tools.loadbench", "main", "TTFT/TPOT sweep against an OpenAI endpoint"),
    "serve": ("kvferry.tools.serve", "main", "start vLLM with kvferry's launch fixes"),
    "preflight": ("kvferry.connector.preflight", "main", "check NIXL, backend plugins and EFA"),
    "inject": ("kvferry.connector.inject", "main", "copy the connector into DIR for a stock vLLM image"),
    "render": ("kvferry.operator.render.cli", "main", "print the objects a DisaggregatedInference makes"),
    "doctor": ("kvferry.tools.doctor.cli", "main", "what a DisaggregatedInference needs from the cluster"),
    "operator": ("kvferry.operator.runtime.run", "main", "run the operator (kopf)"),
    "release-finalizers": (
        "kvferry.operator.runtime.finalizers",
        "main",
        "remove the operator's finalizer from CRs when the operator is gone",
    ),
    "generate": (
        "kvferry.codegen.generate",
        "main",
        "write (or --check) every generated file: CRDs, API reference, chart templates, install.yaml",
    ),
    "cluster": ("kvferry.local.controlplane.cli", "main", "build/start/stop the local control plane"),
    "model": ("kvferry.local.tinymodel", "main", "build the tiny local test model and tokenizer"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: kvferry <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kvferry: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Each image holds only the packages its pods run (images/prune.py): say so, not a traceback.
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            print(f"kvferry {name}: not in this installation ({exc.name} is not installed)", file=sys.stderr)
            return 2
        raise
    entry = getattr(imported, func)
    result = entry(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
