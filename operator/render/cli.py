"""Render CLI step: `kvferry render cr.yaml` prints the objects a DisaggregatedInference makes, offline.

For review and GitOps diffs: no cluster access, no owner references (the CR has no uid yet), and the
same validation the API server applies (errors name the field, exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from kvferry.operator.render import images
from kvferry.operator.render.objects import render
from kvferry.operator.spec import KIND, Inference, SpecError


def _read(source: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry render", description=__doc__.splitlines()[0])
    parser.add_argument(
        "files", nargs="+", help="YAML files with DisaggregatedInference objects ('-' = stdin)"
    )
    parser.add_argument(
        "--registry", default=images.DEFAULT_REGISTRY, help="registry of the kvferry images (image.registry)"
    )
    parser.add_argument("--router-image", default="", help="router image (default: the operator image)")
    parser.add_argument("--revision", action="store_true", help="print only each CR's revision hash")
    args = parser.parse_args(argv)
    out: list[dict[str, Any]] = []
    for source in args.files:
        try:
            docs = _read(source)
        except (OSError, yaml.YAMLError) as exc:
            print(f"kvferry render: cannot read {source}: {exc}", file=sys.stderr)
            return 2
        for doc in docs:
            if doc.get("kind") != KIND:
                print(f"kvferry render: {source}: skipping kind {doc.get('kind')!r}", file=sys.stderr)
                continue
            name = doc.get("metadata", {}).get("name", "?")
            try:
                rendered = render(Inference.of(doc), registry=args.registry, router_image=args.router_image)
            except SpecError as exc:
                print(f"kvferry render: {source}: {name}: {exc}", file=sys.stderr)
                return 2
            if args.revision:
                print(f"{name} {rendered.revision}")
            out += rendered.objects
    if not args.revision:
        sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False, width=120))
    return 0
