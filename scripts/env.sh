# Sourced by the scripts: where the heavy, rebuildable things live (outside the repo, reused across runs).
export KVFERRY_CACHE="${KVFERRY_CACHE:-$HOME/.cache/kvferry}"
export KVFERRY_VENV="${KVFERRY_VENV:-$KVFERRY_CACHE/venv}"
export KVFERRY_BIN="${KVFERRY_BIN:-$KVFERRY_CACHE/bin}"
export PATH="$KVFERRY_VENV/bin:$KVFERRY_BIN:$PATH"
# No hub access at any point: tests build their models locally.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
