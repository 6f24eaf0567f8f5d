#!/usr/bin/env bash
# Installs libpipe's Python binding (built against the libpipe installed at PREFIX) into the
# environment of $LIBPIPE_PYTHON and runs the decoder tests against it, from WORKDIR, with the
# `pipe` tool installed at PREFIX (or $PIPE_CLI when set). Without a test file among the pytest arguments, runs
# every test of this folder.
#
#   run-tests.sh PREFIX WORKDIR [pytest arguments]
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 PREFIX WORKDIR [pytest arguments]" >&2
  exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=$(cd "$1" && pwd)
mkdir -p "$2"
workdir=$(cd "$2" && pwd)
shift 2
python=${LIBPIPE_PYTHON:-python3}

"$here/../../bindings/python/install.sh" "$prefix" "$workdir"

tests=("$here")
for arg in "$@"; do
  case $arg in -*) ;; *.py | *.py::*) tests=() ;; esac
done

cd "$workdir"
exec env -u PYTHONPATH -u LD_LIBRARY_PATH PYTHONDONTWRITEBYTECODE=1 PIPE_CLI="${PIPE_CLI:-$prefix/bin/pipe}" \
  "$python" -m pytest -q -p no:cacheprovider --rootdir="$here" --basetemp="$workdir/pytest-tmp" "$@" "${tests[@]}"
