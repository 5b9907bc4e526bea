"""Keep only what runs in an image: delete every other kvferry module from the installed package, then
import each `kvferry` command the image runs.

kvferry is one project: pyproject.toml lists every package, and setuptools needs every folder to build.
Each image installs it and then removes what does not run there (the dev-only `local/` and `tools/`,
the build-time `codegen/`, ...), so an image holds what its pods run and nothing more. Run by
images/*/Dockerfile in the same RUN as `pip install`, with the image's Python:

    python images/prune.py --keep kvferry.cli kvferry.connector kvferry.contracts --commands preflight

--keep names whole portions (kvferry.connector, ...): what an image runs is a set of folders, each a
package of one lifetime, so nothing is kept module by module. A command that no longer imports after
the prune fails the build, naming the missing module.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import sysconfig
from pathlib import Path


def kept_paths(root: Path, keep: list[str]) -> set[Path]:
    """The folders under `root` (the installed kvferry/) of the portions `keep` names."""
    out: set[Path] = set()
    for name in keep:
        parts = name.split(".")
        if parts[0] != "kvferry" or len(parts) != 2:
            raise ValueError(f"{name}: name a kvferry portion, e.g. kvferry.connector")
        path = root / parts[1]
        if not path.is_dir():
            raise ValueError(f"{name} is not installed under {root}")
        out.add(path)
    return out


def prune(root: Path, keep: list[str]) -> list[Path]:
    """Delete everything under `root` that `keep` does not name; returns what was deleted."""
    kept = kept_paths(root, keep)
    removed: list[Path] = []
    for child in sorted(root.iterdir()):
        if child in kept:
            continue
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
        removed.append(child)
    return removed


def check_commands(commands: list[str]) -> list[str]:
    """Import the module of each `kvferry` command; returns one problem per command that fails."""
    importlib.invalidate_caches()  # the path finders cached the folders as they were before the prune
    from kvferry.cli import COMMANDS

    problems = []
    for command in commands:
        if command not in COMMANDS:
            problems.append(f"{command}: not a kvferry command ({', '.join(COMMANDS)})")
            continue
        module = COMMANDS[command][0]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            problems.append(f"kvferry {command} ({module}): {exc}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", nargs="+", required=True, help="kvferry portions to keep")
    parser.add_argument("--commands", nargs="+", required=True, help="kvferry commands the image runs")
    parser.add_argument(
        "--site", type=Path, help="directory holding the installed kvferry/ (default: this Python's)"
    )
    args = parser.parse_args(argv)
    site = args.site or Path(sysconfig.get_paths()["purelib"])
    root = site / "kvferry"
    if not root.is_dir():
        print(f"prune: no installed kvferry package under {site}", file=sys.stderr)
        return 2
    try:
        removed = prune(root, args.keep)
    except ValueError as exc:
        print(f"prune: {exc}", file=sys.stderr)
        return 2
    top = sorted({p.relative_to(root).parts[0] for p in removed})
    print(
        f"prune: kept {' '.join(args.keep)}; removed {len(removed)} paths under kvferry/ ({', '.join(top)})"
    )
    problems = check_commands(args.commands)
    for problem in problems:
        print(f"prune: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
