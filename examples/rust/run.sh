#!/usr/bin/env bash
# Build the Rust examples against the libpipe installed at PREFIX and run them: example_rust on
# FIXTURES/demo.pt (its output against PyTorch's), and the generation example (src/bin/generate.rs)
# through check_generate.py on FIXTURES/tiny_decoder.pt with a word-level tokenizer against
# transformers' greedy tokens. Exits non-zero if a build fails or an output differs.
#
#   examples/rust/run.sh PREFIX FIXTURES WORKDIR
#
# With --chat, run the chat example (src/bin/chat.rs) instead through examples/check_chat.py on
# CHAT_DIR (made by `check_chat.py prepare`): its prompt ids and reply on SmolLM2 against
# transformers'; exit status 77 when SmolLM2 is missing.
#
#   examples/rust/run.sh --chat PREFIX CHAT_DIR WORKDIR
#
# Every build artefact goes under WORKDIR (CARGO_TARGET_DIR; both modes may share it: cargo
# locks it); crates come from crates.io into the usual cargo cache, at the versions Cargo.lock
# pins. Python: $LIBPIPE_PYTHON, else python3.
set -euo pipefail

chat=0
if [[ ${1:-} == --chat ]]; then
  chat=1
  shift
fi
if [[ $# -ne 3 ]]; then
  echo "usage: $0 [--chat] PREFIX FIXTURES|CHAT_DIR WORKDIR" >&2
  exit 2
fi
prefix=$(cd "$1" && pwd)
fixtures=$(cd "$2" && pwd)
mkdir -p "$3"
workdir=$(cd "$3" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${LIBPIPE_PYTHON:-python3}

export PKG_CONFIG_PATH="$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
libdir=$(pkg-config --variable=libdir libpipe)
export CARGO_TARGET_DIR="$workdir/target"
# The machines are small and shared: build with modest parallelism unless told otherwise.
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

cargo build --locked --quiet --manifest-path "$here/Cargo.toml"

# The binaries link libpipe.so.0 without an rpath, as an application using an installed libpipe
# would; point the loader at PREFIX's copy.
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ $chat == 1 ]]; then
  exec "$python" "$here/../check_chat.py" check "$fixtures" -- "$CARGO_TARGET_DIR/debug/chat"
fi
cargo test --locked --quiet --manifest-path "$here/Cargo.toml"
"$CARGO_TARGET_DIR/debug/example_rust" \
  "$fixtures/demo.pt" "$fixtures/demo.inputs.safetensors" "$fixtures/demo.expected.safetensors"
"$python" "$here/check_generate.py" "$CARGO_TARGET_DIR/debug/generate" "$fixtures" "$workdir/generate"
