#!/usr/bin/env bash
# The GPU suite: installs libpipe's Python binding (built against the libpipe staged at PREFIX)
# into $LIBPIPE_PYTHON's environment and runs the pytest files of this folder on it, with the
# `pipe` tool at $PIPE_CLI. Where PyTorch sees no CUDA device it does nothing and exits 77, which
# ctest reports as SKIPPED; with LIBPIPE_GPU_TEST_DEVICE=cpu it runs anyway, for a dry run of
# test_gpu_generate.py on the CPU (name that file among the pytest arguments).
#   run.sh PREFIX WORKDIR [pytest arguments]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${LIBPIPE_PYTHON:-python3}
if [ -z "${LIBPIPE_GPU_TEST_DEVICE:-}" ] && ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "SKIPPED: PyTorch sees no CUDA device here"
  exit 77
fi
mkdir -p "$2"
workdir=$(cd "$2" && pwd)
"$here/../../bindings/python/install.sh" "$1" "$workdir"
# Every test file here, or those named among the pytest arguments.
tests=("$here")
for arg in "${@:3}"; do
  case $arg in -*) ;; *.py | *.py::*) tests=() ;; esac
done
cd "$workdir"
# The installed binding, not the source tree's; the CPU suites' model classes from tests/models, and the
# decoders of tests/llm (llm_models.py).
exec env -u LD_LIBRARY_PATH PYTHONPATH="$here/../models:$here/../llm" PYTHONDONTWRITEBYTECODE=1 \
  "$python" -m pytest -q -p no:cacheprovider --rootdir="$here" --basetemp="$workdir/pytest-tmp" "${@:3}" "${tests[@]}"
