# Shared settings for the scripts in this folder; sourced, not run.
#   LIBPIPE_VENV   the project virtualenv (default: one per machine, reused by every checkout,
#                  because the PyTorch wheel and its NVIDIA packages are several GB)
#   LIBPIPE_BUILD  the CMake build folder (default: build/ in the checkout)
#   LIBPIPE_TEST_JOBS  how many tests ctest runs at once (default: one more than the cores). Many tests spend
#                  seconds waiting (a driver giving up on a missing worker, a peer's timeout) and hold a slot of
#                  ctest -j while the cores idle: with one slot per core the 2-core suite left a seventh of its
#                  core-time unused; the tests hold on a loaded machine, so the extra one costs no verdict.
LIBPIPE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LIBPIPE_VENV=${LIBPIPE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/libpipe/venv}
LIBPIPE_PYTHON=${LIBPIPE_PYTHON:-$LIBPIPE_VENV/bin/python}
LIBPIPE_BUILD=${LIBPIPE_BUILD:-$LIBPIPE_ROOT/build}
LIBPIPE_TEST_JOBS=${LIBPIPE_TEST_JOBS:-$(($(nproc) + 1))}
export LIBPIPE_ROOT LIBPIPE_VENV LIBPIPE_PYTHON LIBPIPE_BUILD LIBPIPE_TEST_JOBS
