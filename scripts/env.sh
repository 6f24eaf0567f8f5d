# Shared settings for the scripts in this folder; sourced, not run.
#   LIBPIPE_VENV   the project virtualenv (default: one per machine, reused by every checkout,
#                  because the PyTorch wheel and its NVIDIA packages are several GB)
#   LIBPIPE_BUILD  the CMake build folder (default: build/ in the checkout)
LIBPIPE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LIBPIPE_VENV=${LIBPIPE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/libpipe/venv}
LIBPIPE_PYTHON=${LIBPIPE_PYTHON:-$LIBPIPE_VENV/bin/python}
LIBPIPE_BUILD=${LIBPIPE_BUILD:-$LIBPIPE_ROOT/build}
export LIBPIPE_ROOT LIBPIPE_VENV LIBPIPE_PYTHON LIBPIPE_BUILD
