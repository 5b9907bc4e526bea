#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run the demo.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$here/setup.sh"
. "$here/env.sh"
exec kvferry demo "$@"
