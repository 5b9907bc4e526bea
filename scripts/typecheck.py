"""mypy over kvferry's namespace portions, as configured in pyproject.toml [tool.mypy].

mypy finds a module by its path, and kvferry.connector lives in connector/ (pyproject package-dir), so the
portions are linked as .mypy_cache/src/kvferry/<portion> (mypy_path and files point there) and the paths
in mypy's report are mapped back to the repository's. Extra arguments go to mypy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import tomllib
from mypy import api

ROOT = Path(__file__).resolve().parent.parent
LINKS = Path(".mypy_cache/src")


def link_portions() -> dict[str, str]:
    """Link every package-dir portion under LINKS; {link path prefix: repository path prefix}."""
    portions = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    (ROOT / ".mypy_cache").mkdir(exist_ok=True)
    ignore = ROOT / ".mypy_cache" / ".gitignore"  # mypy writes it too, but only once it has a cache
    if not ignore.exists():
        ignore.write_text("*\n")
    wanted: dict[Path, str] = {}
    for package, folder in portions.items():
        link = ROOT / LINKS / Path(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(ROOT / folder, link.parent)
        if not (link.is_symlink() and os.readlink(link) == target):
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(target, target_is_directory=True)
        wanted[link] = folder
    for stale in (ROOT / LINKS / "kvferry").iterdir():
        if stale not in wanted and stale.is_symlink():
            stale.unlink()
    return {f"{link.relative_to(ROOT)}/": f"{folder}/" for link, folder in wanted.items()}


def main(argv: list[str]) -> int:
    os.chdir(ROOT)
    paths = link_portions()
    out, err, status = api.run(argv)
    for prefix, folder in paths.items():
        out = out.replace(prefix, folder)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
