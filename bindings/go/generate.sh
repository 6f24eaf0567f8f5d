#!/bin/sh
# Writes status_gen.go (package pipe's Status constants, Err sentinels and Status.Description)
# from the pipe.h that pkg-config finds for libpipe, with the generator shared by the three
# bindings (bindings/codegen/pipe_constants.py). `go generate` runs it (pipe.go); with --check it
# writes nothing and fails when status_gen.go is not what that header gives (run-tests.sh).
#
#   generate.sh [--check]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
includedir=$(pkg-config --variable=includedir libpipe) || {
  echo "generate.sh: pkg-config finds no libpipe (set PKG_CONFIG_PATH=PREFIX/lib/pkgconfig)" >&2
  exit 1
}
"${LIBPIPE_PYTHON:-python3}" "$here/../codegen/pipe_constants.py" go "$includedir/pipe/pipe.h" \
  "$here/status_gen.go" "$@" || {
  echo "generate.sh: status_gen.go does not match $includedir/pipe/pipe.h: run bindings/go/generate.sh" \
    "(or go generate in bindings/go) with PKG_CONFIG_PATH set for that libpipe, and commit the result" >&2
  exit 1
}
