#!/usr/bin/env bash
# Installs libpipe's Python binding (built against the libpipe at PREFIX) into the environment of
# $LIBPIPE_PYTHON (default python3), then runs main.py on FIXTURES/demo.pt and its inputs and
# reference. Exits non-zero if the output differs from the reference.
#
#   run.sh PREFIX FIXTURES WORKDIR
#
# With --chat, runs chat.py instead through examples/check_chat.py on CHAT_DIR (made by
# `check_chat.py prepare`): its prompt ids and reply against transformers'; exit status 77 when
# SmolLM2 is missing.
#
#   run.sh --chat PREFIX CHAT_DIR WORKDIR
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
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
prefix=$(cd "$1" && pwd)
fixtures=$(cd "$2" && pwd)
mkdir -p "$3"
workdir=$(cd "$3" && pwd)
python=${LIBPIPE_PYTHON:-python3}

"$here/../../bindings/python/install.sh" "$prefix" "$workdir"

cd "$workdir"  # not the source tree, so the installed package is the one imported
if [ $chat = 1 ]; then
  exec env -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 "$python" "$here/../check_chat.py" check "$fixtures" -- \
    "$python" "$here/chat.py"
fi
exec env -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 "$python" "$here/main.py" \
  "$fixtures/demo.pt" "$fixtures/demo.inputs.safetensors" "$fixtures/demo.expected.safetensors"
