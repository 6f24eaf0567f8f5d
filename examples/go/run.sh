#!/usr/bin/env bash
# Build the Go examples against the libpipe installed at PREFIX and run the pipeline demo on the
# demo model.
#
#   examples/go/run.sh PREFIX FIXTURES WORKDIR
#
# With --chat, run the chat example (chat/) instead through examples/check_chat.py on CHAT_DIR
# (made by `check_chat.py prepare`): its prompt ids and reply against transformers'; exit status
# 77 when SmolLM2 is missing.
#
#   examples/go/run.sh --chat PREFIX CHAT_DIR WORKDIR
#
# The binaries are WORKDIR/example_go and WORKDIR/example_go_chat, with PREFIX/lib as their
# runpath; Go's build cache is shared (see bindings/go/build-env.sh). Exits non-zero if the
# pipelined output differs from PyTorch's reference.
set -euo pipefail

chat=0
if [ "${1:-}" = --chat ]; then
  chat=1
  shift
fi
if [ $# -ne 3 ]; then
  echo "usage: $0 [--chat] PREFIX FIXTURES|CHAT_DIR WORKDIR" >&2
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
go vet ./...
if [ $chat = 1 ]; then
  go build -ldflags "-r $PREFIX/lib" -o "$WORKDIR/example_go_chat" ./chat
  exec "${LIBPIPE_PYTHON:-python3}" "$HERE/../check_chat.py" check "$FIXTURES" -- "$WORKDIR/example_go_chat"
fi
go build -ldflags "-r $PREFIX/lib" -o "$WORKDIR/example_go" .
"$WORKDIR/example_go" "$FIXTURES/demo.pt" "$FIXTURES/demo.inputs.safetensors" "$FIXTURES/demo.expected.safetensors"
