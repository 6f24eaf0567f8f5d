#!/usr/bin/env bash
# Builds libpipe, its tools and its tests with AddressSanitizer and UndefinedBehaviorSanitizer in
# a second build folder and runs the whole suite there (LibTorch is not instrumented; its
# allocations are still tracked by the sanitizer runtime). Extra arguments go to ctest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$LIBPIPE_ROOT/scripts/install-deps.sh"
build=${LIBPIPE_SANITIZE_BUILD:-$LIBPIPE_ROOT/build-sanitize}
cmake -S "$LIBPIPE_ROOT" -B "$build" -G Ninja -DLIBPIPE_PYTHON="$LIBPIPE_PYTHON" \
  -DLIBPIPE_SANITIZE=address,undefined >/dev/null
cmake --build "$build"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:exitcode=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The engine's unit tests are left out here: conformance_generate drives the same engine through the C ABI under
# these sanitizers, and the engine's threads run under TSan (test-tsan.sh); the unit tests run in the plain suite.
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" -E '^Engine\.' "$@"
