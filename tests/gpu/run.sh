#!/usr/bin/env bash
# The GPU suite: installs libpipe's Python binding (built against the libpipe staged at PREFIX)
# into $LIBPIPE_PYTHON's environment and runs the pytest files of this folder on it, with the
# `pipe` tool at $PIPE_CLI. Where PyTorch sees no CUDA device it does nothing and exits 77, which
# ctest reports as SKIPPED.
#   run.sh PREFIX WORKDIR
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${LIBPIPE_PYTHON:-python3}
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "SKIPPED: PyTorch sees no CUDA device here"
  exit 77
fi
mkdir -p "$2"
workdir=$(cd "$2" && pwd)
"$here/../../bindings/python/install.sh" "$1" "$workdir"
cd "$workdir"
# The installed binding, not the source tree's; the CPU suites' model classes from tests/models.
exec env -u LD_LIBRARY_PATH PYTHONPATH="$here/../models" PYTHONDONTWRITEBYTECODE=1 \
  "$python" -m pytest -q -p no:cacheprovider --rootdir="$here" --basetemp="$workdir/pytest-tmp" "$here" "${@:3}"
