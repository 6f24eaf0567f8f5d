#!/usr/bin/env bash
# Build the Rust binding (pipe-sys + pipe) against the libpipe installed at PREFIX and run its
# tests: the unit tests, the integration tests in pipe/tests/ (demo vs reference, errors,
# cancellation and deadlines, request futures and file descriptors run by a tiny executor in
# the tests, many calls awaited by one thread, concurrent use of one session, a Gloo session
# whose worker is the test binary itself run again as a child process, token generation against
# transformers' greedy tokens) and the doc tests.
#
#   bindings/rust/run-tests.sh PREFIX FIXTURES WORKDIR
#
# PREFIX    a libpipe install (PREFIX/lib/pkgconfig/libpipe.pc, include/pipe/pipe.h, lib/libpipe.so)
# FIXTURES  folder with demo.pt, demo.{inputs,expected}.safetensors, gated.scripted.pt and its
#           safetensors files, the decoders tiny_decoder.pt (with tiny_decoder.expected.json) and
#           gated_decoder.pt, and the test gate's operator library libpipe_test_gate.so, which the
#           tests load (pipe/tests/common/gate.rs) to hold a stage while they act
# WORKDIR   where every build artefact goes (CARGO_TARGET_DIR=WORKDIR/target)
#
# Needs cargo, pkg-config and libclang (Debian: libclang-dev) for bindgen. The test binaries get
# an rpath to PREFIX's lib folder from the crates' build scripts, so no LD_LIBRARY_PATH is set.
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
pkg-config --exists libpipe || { echo "libpipe.pc not found under $prefix/lib/pkgconfig" >&2; exit 1; }
export CARGO_TARGET_DIR="$workdir/target"
export LIBPIPE_FIXTURES="$fixtures"
# The machines are small and shared: build with modest parallelism unless told otherwise.
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

cargo test --locked --workspace --manifest-path "$here/Cargo.toml"
