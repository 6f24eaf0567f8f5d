#!/usr/bin/env bash
# Build the Go binding against the libpipe installed at PREFIX and run its tests.
#
#   bindings/go/run-tests.sh PREFIX FIXTURES WORKDIR
#
# PREFIX    an installed libpipe (PREFIX/lib/pkgconfig/libpipe.pc, PREFIX/lib/libpipe.so)
# FIXTURES  the directory holding demo.pt, gated.scripted.pt, their safetensors files and the
#           test gate's operator library libpipe_test_gate.so (loaded by the tests: gate_test.go)
# WORKDIR   scratch space: test binaries and go's temporary files go here, never into the tree
#
# Steps: gofmt, go vet, then go test (with the race detector where Go has one, cgocheck at its
# default level). `go build` runs SWIG on internal/capi/capi.swig itself. build-env.sh sets up
# the environment: Go's build cache stays where `go env GOCACHE` says (shared, so warm runs are
# fast) but is keyed on the installed pipe.h, which Go itself does not track (see the comment
# there); it moves under WORKDIR only when Go has no cache directory (no HOME). Nothing is
# downloaded: the module has no dependencies.
# Env: LIBPIPE_GO_RACE=0 skips the race detector; LIBPIPE_GO_CGOCHECK2=1 also runs the tests
# with GOEXPERIMENT=cgocheck2 (rebuilds the standard library once, about a minute).
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

# shellcheck source=build-env.sh
. "$HERE/build-env.sh"
export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LIBPIPE_FIXTURES="$FIXTURES"

race=()
case "$(go env GOOS)/$(go env GOARCH)" in
  linux/amd64 | linux/arm64) [ "${LIBPIPE_GO_RACE:-1}" = 0 ] || race=(-race) ;;
esac

cd "$HERE"
echo "== $(go version), $(swig -version | grep -m1 Version), libpipe $(pkg-config --modversion libpipe) (install id $LIBPIPE_GO_INSTALL_ID)"

# status_gen.go is generated from pipe.h but committed (see pipe.go for why): it must be what the
# installed header gives, or the binding would lack a status code.
echo "== status_gen.go matches $(pkg-config --variable=includedir libpipe)/pipe/pipe.h"
"$HERE/generate.sh" --check

# go vet cannot check a package built from a .swig file (cmd/go gives vet the SWIG output's
# path before SWIG has run), so vet covers the package written by hand; the SWIG package is
# compiled (with all C warnings) by the test build below.
echo "== gofmt, go vet ."
unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || { echo "run-tests.sh: not gofmt-formatted: $unformatted" >&2; exit 1; }
go vet .

echo "== go test ${race[*]} ./..."
go test "${race[@]}" -count=1 -timeout 10m ./...

if [ "${LIBPIPE_GO_CGOCHECK2:-0}" = 1 ]; then
  echo "== GOEXPERIMENT=cgocheck2 go test ./..."
  GOEXPERIMENT=cgocheck2 go test -count=1 -timeout 10m ./...
fi
echo "== Go binding: all tests passed"
