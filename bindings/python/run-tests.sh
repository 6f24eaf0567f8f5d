#!/usr/bin/env bash
# Builds libpipe's Python binding against the libpipe installed at PREFIX, installs it into the
# environment of $LIBPIPE_PYTHON (default python3), and runs its tests on the fixtures in
# FIXTURES (demo.pt, demo.inputs/expected.safetensors, slow_loop.scripted.pt, ...).
#
#   run-tests.sh PREFIX FIXTURES WORKDIR
#
# Everything built or written goes under WORKDIR. The tests run with PYTHONPATH and
# LD_LIBRARY_PATH unset, from WORKDIR: they test the installed package, which finds libpipe
# through the rpath recorded at build time.
set -euo pipefail

if [ $# -ne 3 ]; then
  echo "usage: $0 PREFIX FIXTURES WORKDIR" >&2
  exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=$(cd "$1" && pwd)
fixtures=$(cd "$2" && pwd)
mkdir -p "$3"
workdir=$(cd "$3" && pwd)
python=${LIBPIPE_PYTHON:-python3}

"$here/install.sh" "$prefix" "$workdir"

cd "$workdir"
exec env -u PYTHONPATH -u LD_LIBRARY_PATH PYTHONDONTWRITEBYTECODE=1 \
  LIBPIPE_FIXTURES="$fixtures" \
  "$python" -m pytest -q -p no:cacheprovider --rootdir="$here/tests" \
  --basetemp="$workdir/pytest-tmp" "$here/tests"
