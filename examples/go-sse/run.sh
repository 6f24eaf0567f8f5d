#!/usr/bin/env bash
# Build the streaming completion service against the libpipe installed at PREFIX and run its test,
# which starts the service and queries it over HTTP (server_test.go).
#
#   examples/go-sse/run.sh PREFIX FIXTURES WORKDIR
#
# FIXTURES holds the decoder fixtures (tiny_decoder.pt, tiny_decoder.expected.json,
# gated_decoder.pt) and the test gate's libpipe_test_gate.so (tests/bindings/stage.cmake copies
# them); PIPE_TEST_MODELS, when set, is searched too. With LIBPIPE_PYTHON set (ctest sets it) and
# SmolLM2-135M-Instruct converted on this machine (scripts/install-deps.sh does it), the test
# serves SmolLM2: testdata/smollm2.py exports its decoder and transformers' reference into
# WORKDIR once (kept while its inputs do not change). Otherwise it serves the tiny decoder.
# The test also drives the service with curl and, through LIBPIPE_PYTHON, with OpenAI's Python
# client (testdata/openai_client_check.py; the `openai` package of scripts/requirements.txt).
#
# Unlike the binding, this module has third-party dependencies (the tokenizer): go fetches them
# through the Go module proxy the first time (checked against go.sum), then finds them in the
# module cache.
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
ROOT=$(cd "$HERE/../.." && pwd)

proxy=$(go env GOPROXY)
# shellcheck source=../../bindings/go/build-env.sh
. "$ROOT/bindings/go/build-env.sh"
export GOPROXY="$proxy" # build-env.sh turns it off: the binding needs nothing downloaded

cd "$HERE"
unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || { echo "run.sh: not gofmt-formatted: $unformatted" >&2; exit 1; }
go vet .
go build -ldflags "-r $PREFIX/lib" -o "$WORKDIR/go-sse" .

smollm2=""
if [ -n "${LIBPIPE_PYTHON:-}" ]; then
  PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}" \
    "$LIBPIPE_PYTHON" "$HERE/testdata/smollm2.py" "$ROOT" "$WORKDIR/smollm2"
  [ -f "$WORKDIR/smollm2/smollm2.json" ] && smollm2="$WORKDIR/smollm2/smollm2.json"
fi

export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
GO_SSE_BIN="$WORKDIR/go-sse" GO_SSE_SMOLLM2="$smollm2" LIBPIPE_FIXTURES="$FIXTURES" \
  go test -count=1 -timeout 10m -v .
