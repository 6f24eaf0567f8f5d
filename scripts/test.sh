#!/usr/bin/env bash
# The README's second command: install, build, and run every test through ctest.
# Extra arguments go to ctest (for example: -L unit, -R safetensors).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$LIBPIPE_ROOT/scripts/install-deps.sh"
"$LIBPIPE_ROOT/scripts/build.sh"
ctest --test-dir "$LIBPIPE_BUILD" --output-on-failure -j "$(nproc)" "$@"
