#!/usr/bin/env bash
# Builds pipe-serve against a libpipe found through PREFIX/lib/pkgconfig/libpipe.pc, as the Go
# binding's users build their programs (bindings/go/build-env.sh: pkg-config, SWIG, and Go's build
# cache keyed on that libpipe's header).
#
#   serve/build.sh PREFIX OUT [LIBDIR]
#
# CMake's pipe_serve target runs it with a PREFIX that holds only a libpipe.pc of the build tree,
# and installs OUT into bin/ beside the library. The binary's run path is $ORIGIN/../LIBDIR
# (default lib), where the installed library is, then $ORIGIN, where it is in the build tree: so
# both build/pipe-serve and PREFIX/bin/pipe-serve find their libpipe without LD_LIBRARY_PATH.
#
# Unlike the binding, this module has third-party dependencies (Prometheus' client; the tokenizer
# and the chat template are libpipe's own): go fetches them through the Go module proxy the first
# time (checked against go.sum), then finds them in the module cache.
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: $0 PREFIX OUT [LIBDIR]" >&2
  exit 2
fi
PREFIX=$(cd "$1" && pwd)
mkdir -p "$(dirname "$2")"
OUT=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
LIBDIR=${3:-lib}
WORKDIR=$(dirname "$OUT")/pipe-serve.go # build-env.sh's GOTMPDIR goes under it
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

proxy=$(go env GOPROXY 2>/dev/null || true)
# shellcheck source=../bindings/go/build-env.sh
. "$HERE/../bindings/go/build-env.sh"
export GOPROXY="$proxy" # build-env.sh turns it off: the binding needs nothing downloaded, this does

cd "$HERE"
# shellcheck disable=SC2016 # $ORIGIN is for the dynamic loader, not the shell
if ! go build -ldflags '-r $ORIGIN/../'"$LIBDIR"':$ORIGIN' -o "$OUT" .; then
  echo "serve/build.sh: building pipe-serve failed (Go >= 1.26 is needed, and the Go module proxy" \
    "the first time); configure with -DLIBPIPE_BUILD_SERVE=OFF to build libpipe without it" >&2
  exit 1
fi
