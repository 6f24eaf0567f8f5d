#!/usr/bin/env bash
# Records the current ABI of build/libpipe.so (its functions and the types of the pipe.h the build
# generated from capi/include/pipe/pipe.h.in) as the baseline the conformance suite compares
# against (capi/libpipe.abi.xz), and the exported symbol list (capi/libpipe.symbols). Run it only
# when an ABI change is intended: additions at a minor release, anything incompatible together
# with a new major in project(libpipe VERSION ...) of CMakeLists.txt. Commit both files with the
# change that needs them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
lib=$LIBPIPE_BUILD/libpipe.so
abidw --headers-dir "$LIBPIPE_BUILD/include/pipe" --drop-private-types --no-corpus-path "$lib" |
  xz -9 >"$LIBPIPE_ROOT/capi/libpipe.abi.xz"
{
  echo "# The symbols libpipe.so exports, one per line (scripts/update-abi-baseline.sh writes it)."
  nm -D --defined-only "$lib" | awk '$2 != "A" {print $3}' | sed 's/@.*//' | sort -u
} >"$LIBPIPE_ROOT/capi/libpipe.symbols"
echo "updated capi/libpipe.abi.xz and capi/libpipe.symbols"
