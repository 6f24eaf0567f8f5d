#!/usr/bin/env bash
# The GPU suite: builds libpipe (the CUDA paths are compiled whenever the wheel's CUDA runtime is
# there, as in every build) and runs the tests labelled `gpu` through ctest. Where there is no GPU
# they report SKIPPED, never failed. Extra arguments go to ctest. Where PyTorch sees a GPU it then runs
# bench/gpu_generate.py (token generation against transformers on that GPU; LIBPIPE_GPU_BENCH=0
# leaves it out) and writes its figures to $LIBPIPE_BUILD/gpu_generate.json as well.
#
# On a machine that already has PyTorch (e.g. a GPU machine whose image carries it) and the
# Debian packages of scripts/install-deps.sh, skip the installer and point the scripts at that
# Python:  LIBPIPE_SKIP_INSTALL=1 LIBPIPE_PYTHON=/path/to/python scripts/test-gpu.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
[ "${LIBPIPE_SKIP_INSTALL:-0}" = 1 ] || "$LIBPIPE_ROOT/scripts/install-deps.sh"
"$LIBPIPE_ROOT/scripts/build.sh"
ctest --test-dir "$LIBPIPE_BUILD" --output-on-failure -L gpu "$@"
if [ "${LIBPIPE_GPU_BENCH:-1}" != 0 ] &&
  "$LIBPIPE_PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  "$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/bench/gpu_generate.py" --pipe "$LIBPIPE_BUILD/pipe" \
    --work "$LIBPIPE_BUILD/gpu-bench" --out "$LIBPIPE_BUILD/gpu_generate.json"
fi
