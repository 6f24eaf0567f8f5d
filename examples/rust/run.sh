#!/usr/bin/env bash
# Build the Rust example against the libpipe installed at PREFIX and run it on FIXTURES/demo.pt.
# Exits non-zero if the build fails or the output differs from PyTorch's.
#
#   examples/rust/run.sh PREFIX FIXTURES WORKDIR
#
# Every build artefact goes under WORKDIR (CARGO_TARGET_DIR); crates come from crates.io into
# the usual cargo cache, at the versions Cargo.lock pins.
set -euo pipefail

if [[ $# -ne 3 ]]; then
  echo "usage: $0 PREFIX FIXTURES WORKDIR" >&2
  exit 2
fi
prefix=$(cd "$1" && pwd)
fixtures=$(cd "$2" && pwd)
mkdir -p "$3"
workdir=$(cd "$3" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export PKG_CONFIG_PATH="$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
libdir=$(pkg-config --variable=libdir libpipe)
export CARGO_TARGET_DIR="$workdir/target"
# The machines are small and shared: build with modest parallelism unless told otherwise.
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

cargo build --locked --quiet --manifest-path "$here/Cargo.toml"

# The binary links libpipe.so.0 without an rpath, as an application using an installed libpipe
# would; point the loader at PREFIX's copy.
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  "$CARGO_TARGET_DIR/debug/example_rust" \
  "$fixtures/demo.pt" "$fixtures/demo.inputs.safetensors" "$fixtures/demo.expected.safetensors"
