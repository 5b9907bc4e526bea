#!/usr/bin/env bash
# The test command: set up (idempotent), lint (ruff, import layering, types), then run every suite
# (unit, nixl, cluster, wheel, e2e; the wheel tier builds and installs the wheel, cached per source hash).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not e2e"`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
"$here/setup.sh"
. "$here/env.sh"
cd "$root"
ruff check .
ruff format --check .
# Generated files (CRDs, API reference, chart templates, install.yaml) equal a fresh generation.
kvferry generate --check
# Layering: the import contracts of docs/architecture.md "Layering rules" (pyproject [tool.importlinter]).
lint-imports --no-logo
# Types: mypy, strict except the not-yet-typed modules pyproject [tool.mypy] lists.
python scripts/typecheck.py
# The slowest tests, printed at the end: where to trim when the run grows.
exec python -m pytest --durations=25 "$@"
