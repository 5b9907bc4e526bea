"""`python -m kvferry.local.chart sync|check`: write, or verify, every generated install artifact.

sync   regenerate charts/kvferry/templates/{crd-disaggregatedinferences.yaml,_rbac-rules.tpl} from the
       operator's outputs, then manifests/install.yaml from the chart (`helm template`).
check  regenerate in memory and exit 1 naming every committed file that differs (what the tests run).
"""

from __future__ import annotations

import argparse
import sys

from kvferry.local.chart import artifacts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvferry.local.chart", description=__doc__.splitlines()[0]
    )
    parser.add_argument("action", choices=["sync", "check"])
    args = parser.parse_args(argv)
    wanted = artifacts.render_all()
    stale = artifacts.stale(wanted)
    if args.action == "check":
        for path in stale:
            print(f"stale: {path.relative_to(artifacts.ROOT)} (run `python -m kvferry.local.chart sync`)")
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(artifacts.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
