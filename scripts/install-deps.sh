#!/usr/bin/env bash
# Installs what libpipe's build, demo and tests need: Debian packages and the project virtualenv
# with the pinned PyTorch wheel (which carries LibTorch). Idempotent, and quick when everything
# is already there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

apt_packages=(
  build-essential cmake ninja-build pkg-config   # toolchain
  python3 python3-venv                           # the virtualenv (when no other python3 is on PATH)
  libdlpack-dev nlohmann-json3-dev               # public DLPack header; JSON for plans and safetensors
  libzip-dev                                     # model files are zip archives, checked before LibTorch reads them
  libcmocka-dev libgtest-dev                     # conformance (C) and unit (C++) tests
  abigail-tools binutils xz-utils                # ABI check (abidw/abidiff), export check (nm, objdump)
  swig                                           # the Python and Go bindings are generated from pipe.h
  clang libclang-dev                             # bindgen (the Rust binding's -sys crate)
  libclang-rt-dev                                # clang's fuzzer and sanitizer runtimes (scripts/fuzz.sh links them)
  libssl-dev                                     # libcrypto: HMAC-SHA256 for authenticating connections between processes
  curl                                           # pipe-serve's test (serve/) drives the service with curl
  iproute2                                       # ip netns and tc: two hosts on one machine (tests/distributed)
)
missing=()
for pkg in "${apt_packages[@]}"; do
  [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "install-deps: installing Debian packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The Go and Rust bindings build with the machine's own toolchains (Go >= 1.24, and 1.26 for
# pipe-serve, serve/; Rust >= 1.80); Debian's packages are too old for them, so say where they come
# from rather than fail later.
command -v go >/dev/null || echo "install-deps: warning: no 'go' on PATH; pipe-serve is not built and the Go binding's tests will fail (https://go.dev/dl)" >&2
command -v cargo >/dev/null || echo "install-deps: warning: no 'cargo' on PATH; the Rust binding's tests will fail (https://rustup.rs)" >&2

requirements=$LIBPIPE_ROOT/scripts/requirements.txt
nodeps=$LIBPIPE_ROOT/scripts/requirements-nodeps.txt
stamp=$LIBPIPE_VENV/.libpipe-requirements
# The stamp is both files as last installed: a change to either installs again.
if ! { [ -x "$LIBPIPE_PYTHON" ] && cat "$requirements" "$nodeps" | cmp -s - "$stamp" &&
  "$LIBPIPE_PYTHON" -c "import torch" 2>/dev/null; }; then
  if [ ! -x "$LIBPIPE_PYTHON" ]; then
    echo "install-deps: creating the virtualenv $LIBPIPE_VENV"
    mkdir -p "$(dirname "$LIBPIPE_VENV")"
    python3 -m venv "$LIBPIPE_VENV"
  fi
  echo "install-deps: installing Python packages (the PyTorch wheel is several GB the first time)"
  "$LIBPIPE_PYTHON" -m pip install -q --disable-pip-version-check -r "$requirements"
  "$LIBPIPE_PYTHON" -m pip install -q --disable-pip-version-check --no-deps -r "$nodeps"
  cat "$requirements" "$nodeps" >"$stamp"
fi

# The real model of the generation tests, converted from its GGUF once per machine (about a
# minute, 1.5 GB of memory) so that tests never wait on it; a fraction of a second when cached.
# The tests call the same converter, so a machine that skipped this still works.
"$LIBPIPE_PYTHON" "$LIBPIPE_ROOT/tests/models/smollm2.py" >/dev/null
