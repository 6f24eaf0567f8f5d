#!/usr/bin/env bash
# Build the Go example against the libpipe installed at PREFIX and run it on the demo model.
#
#   examples/go/run.sh PREFIX FIXTURES WORKDIR
#
# The binary is WORKDIR/example_go, with PREFIX/lib as its runpath; Go's build cache is shared
# (see bindings/go/build-env.sh). Exits non-zero if the pipelined output differs from PyTorch's
# reference.
set -euo pipefail

if [ $# -ne 3 ]; then
  echo "usage: $0 PREFIX FIXTURES WORKDIR" >&2
  exit 2
fi
PREFIX=$(cd "$1" && pwd)
FIXTURES=$(cd "$2" && pwd)
mkdir -p "$3"
WORKDIR=$(cd "$3" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The binding's build environment: PKG_CONFIG_PATH, GOTMPDIR under WORKDIR, and Go's build
# cache keyed on the installed pipe.h, which Go itself does not notice changing (see there).
# shellcheck source=../../bindings/go/build-env.sh
. "$HERE/../../bindings/go/build-env.sh"

cd "$HERE"
go vet .
go build -ldflags "-r $PREFIX/lib" -o "$WORKDIR/example_go" .
"$WORKDIR/example_go" "$FIXTURES/demo.pt" "$FIXTURES/demo.inputs.safetensors" "$FIXTURES/demo.expected.safetensors"
