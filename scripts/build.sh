#!/usr/bin/env bash
# Configures and builds libpipe (Release) in $LIBPIPE_BUILD. Assumes install-deps.sh has run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cmake -S "$LIBPIPE_ROOT" -B "$LIBPIPE_BUILD" -G Ninja -DLIBPIPE_PYTHON="$LIBPIPE_PYTHON" >/dev/null
cmake --build "$LIBPIPE_BUILD"
