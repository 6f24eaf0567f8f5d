#!/usr/bin/env bash
# Installs libpipe's Python binding (this folder) into the Python environment of $LIBPIPE_PYTHON
# (default python3), built against the libpipe installed at PREFIX (found with pkg-config).
#
#   install.sh PREFIX WORKDIR
#
# The build runs in a copy of the sources under WORKDIR/python-build (setuptools writes build/ and
# *.egg-info next to the sources), so the source tree stays clean. A second run with the same
# sources, libpipe and interpreter does nothing.
#
# Build isolation: off (--no-build-isolation) when the environment's own setuptools can build
# wheels (setuptools >= 70.1, or the `wheel` package): nothing is downloaded, the build uses the
# pinned toolchain of the environment, and it works offline. Otherwise pip builds in an isolated
# environment, which downloads setuptools from PyPI. LIBPIPE_PIP_ISOLATION=1 forces isolation.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 PREFIX WORKDIR" >&2
  exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=$(cd "$1" && pwd)
mkdir -p "$2"
workdir=$(cd "$2" && pwd)
python=${LIBPIPE_PYTHON:-python3}

export PKG_CONFIG_PATH="$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
if ! pkg-config --exists libpipe; then
  echo "install.sh: pkg-config finds no libpipe under $prefix/lib/pkgconfig" >&2
  exit 1
fi

# What the installed module depends on: our sources, the libpipe it links, the interpreter.
fingerprint() {
  (
    cd "$here"
    find pyproject.toml setup.py MANIFEST.in README.md swig libpipe -type f \
      ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum
    sha256sum "$here/../codegen/pipe_constants.py"
    sha256sum "$prefix/include/pipe/pipe.h"
    stat -L -c '%n %s %Y' "$prefix/lib/libpipe.so"
    echo "$prefix"
    "$python" -c 'import sys; print(sys.executable, sys.version)'
  ) | sha256sum | cut -d' ' -f1
}
# The installed extension, as found from a neutral directory without PYTHONPATH (located, not
# imported: importing the package would import torch).
installed_native() {
  (cd / && env -u PYTHONPATH "$python" - 2>/dev/null <<'PY'
import glob, importlib.util, os
spec = importlib.util.find_spec("libpipe")
for path in glob.glob(os.path.join(spec.submodule_search_locations[0], "_native*.so")):
    print(path, os.stat(path).st_mtime_ns)
PY
  ) || true
}

# The environment records what it holds, so that scripts sharing it (the tests and the example,
# run at once by ctest -j) neither rebuild nor reinstall under each other: the check and the
# install happen under one lock per environment.
envdir=$("$python" -c 'import sys; print(sys.prefix)')
stamp=$envdir/.libpipe-python-install.stamp
want=$(fingerprint)
exec 9>"$envdir/.libpipe-python-install.lock"
if command -v flock >/dev/null; then flock 9; fi
if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$want" ] && [ "$(sed -n 2p "$stamp")" = "$(installed_native)" ]; then
  exit 0  # this exact build is what the environment holds
fi

build=$workdir/python-build
if [ "$(cat "$build/.fingerprint" 2>/dev/null)" != "$want" ]; then
  # Another libpipe (or another build of it: a symbol may have moved to a newer version node) or other
  # sources: build from scratch, since setuptools would keep an extension linked against the old library.
  rm -rf "$build"
fi
mkdir -p "$build"
echo "$want" >"$build/.fingerprint"
rm -rf "$build/libpipe" "$build/swig" "$build/codegen"
cp -p "$here/pyproject.toml" "$here/setup.py" "$here/MANIFEST.in" "$here/README.md" "$build/"
cp -rp "$here/libpipe" "$here/swig" "$build/"
# The generator of libpipe/_constants.py (setup.py runs it on the installed pipe.h).
mkdir -p "$build/codegen"
cp -p "$here/../codegen/pipe_constants.py" "$build/codegen/"
find "$build/libpipe" -name __pycache__ -prune -exec rm -rf {} +

# The check says nothing itself (no setuptools at all, or an odd version string, is "cannot"): the
# one line below is printed only when the fallback is taken.
isolation=(--no-build-isolation)
if [ "${LIBPIPE_PIP_ISOLATION:-0}" = 1 ]; then
  isolation=()
elif ! "$python" - 2>/dev/null <<'PY'
import importlib.util, re, sys
import setuptools
major, minor = (int(p) for p in re.match(r"(\d+)\.(\d+)", setuptools.__version__).groups())
sys.exit(0 if (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") else 1)
PY
then
  isolation=()
  echo "install.sh: building with pip's build isolation (downloads setuptools from PyPI):" \
    "this environment's setuptools cannot build wheels by itself (needs setuptools>=70.1 or wheel)"
fi

(cd "$workdir" && env -u PYTHONPATH "$python" -m pip install --quiet --disable-pip-version-check \
  --no-deps "${isolation[@]}" "$build")
printf '%s\n%s\n' "$want" "$(installed_native)" >"$stamp"
