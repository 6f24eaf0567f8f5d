#!/usr/bin/env bash
# Installs libpipe into a temporary prefix and uses it the ways consumers do: the header alone
# as C99, C11 and C++17 with -Wall -Wextra -Werror -pedantic; a C program built with
# `pkg-config --cflags --libs libpipe`; a CMake project with find_package(pipe); dlopen + dlsym.
# Both programs run the demo model and check it against PyTorch's output.
#   check_install.sh BUILD_DIR SOURCE_DIR DEMO_DIR CC CXX
set -euo pipefail
build=$1 src=$2 demo=$3 cc=$4 cxx=$5
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null

# A sanitizer build of libpipe needs its consumers built with the same runtime.
# (Read the whole listing first: `objdump | grep -q` under pipefail fails at random when grep
# exits early and objdump dies of SIGPIPE, which once built the consumers without the runtime.)
san=""
dynamic=$(objdump -p "$build/libpipe.so")
if [[ $dynamic =~ NEEDED[[:space:]]+libasan ]]; then san="-fsanitize=address,undefined"; fi

# The installed header is the one the build generated from pipe.h.in (its version filled in from
# CMake's project()), and the SONAME's major is the header's.
header=$prefix/include/pipe/pipe.h
[ -f "$header" ] || { echo "missing from the install: include/pipe/pipe.h"; exit 1; }
cmp -s "$header" "$build/include/pipe/pipe.h" || { echo "installed pipe.h is not $build/include/pipe/pipe.h"; exit 1; }
major=$(grep -E '^#define PIPE_VERSION_MAJOR' "$header" | awk '{print $3}')
[[ $major =~ ^[0-9]+$ ]] || { echo "installed pipe.h has no numeric PIPE_VERSION_MAJOR ('$major')"; exit 1; }
for f in include/pipe/pipe.h lib/libpipe.so "lib/libpipe.so.$major" lib/pkgconfig/libpipe.pc \
         lib/cmake/pipe/pipeConfig.cmake lib/cmake/pipe/pipeConfigVersion.cmake bin/pipe; do
  [ -e "$prefix/$f" ] || { echo "missing from the install: $f"; exit 1; }
done
[ -L "$prefix/lib/libpipe.so" ] || { echo "lib/libpipe.so should be a symlink"; exit 1; }

echo '#include <pipe/pipe.h>' > "$prefix/header.c"
for std in c99 c11; do
  "$cc" -std=$std -Wall -Wextra -Werror -pedantic -I"$prefix/include" -fsyntax-only "$prefix/header.c"
done
cp "$prefix/header.c" "$prefix/header.cpp"
"$cxx" -std=c++17 -Wall -Wextra -Werror -pedantic -I"$prefix/include" -fsyntax-only "$prefix/header.cpp"
echo "header compiles alone as C99, C11 and C++17"

# A dropped status is a warning (PIPE_WARN_UNUSED_RESULT), unless PIPE_NO_WARN_UNUSED_RESULT turns
# the mark off; in C and in C++, with GCC or Clang as configured. Compiled to an object: GCC gives
# this warning after parsing, so -fsyntax-only would never show it.
printf '#include <pipe/pipe.h>\nvoid dropped(void);\nvoid dropped(void) { pipe_session_check(NULL); }\n' \
  >"$prefix/unused.c"
cp "$prefix/unused.c" "$prefix/unused.cpp"
for compile in "$cc -std=c11 $prefix/unused.c" "$cxx -std=c++17 $prefix/unused.cpp"; do
  # shellcheck disable=SC2086 # the compiler and its arguments are words
  if $compile -Werror=unused-result -I"$prefix/include" -c -o /dev/null 2>/dev/null; then
    echo "ignoring a pipe_status compiles without a warning: PIPE_WARN_UNUSED_RESULT is not in effect ($compile)"
    exit 1
  fi
  # shellcheck disable=SC2086
  $compile -Werror=unused-result -DPIPE_NO_WARN_UNUSED_RESULT -I"$prefix/include" -c -o /dev/null ||
    { echo "PIPE_NO_WARN_UNUSED_RESULT does not turn the warning off ($compile)"; exit 1; }
done
echo "a dropped pipe_status warns, and PIPE_NO_WARN_UNUSED_RESULT turns that off"

export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# shellcheck disable=SC2046
"$cc" -std=c11 $san -o "$prefix/pc_example" "$src/examples/c/main.c" $(pkg-config --cflags --libs libpipe) -lm
LD_LIBRARY_PATH=$prefix/lib "$prefix/pc_example" "$demo/demo.pt" "$demo/demo.inputs.safetensors" "$demo/demo.expected.safetensors"

cmake -S "$src/tests/conformance/consumer" -B "$prefix/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" \
  -DEXAMPLE_SOURCE="$src/examples/c/main.c" >/dev/null
cmake --build "$prefix/consumer" >/dev/null
"$prefix/consumer/consumer" "$demo/demo.pt" "$demo/demo.inputs.safetensors" "$demo/demo.expected.safetensors"

"$cc" -std=c11 $san -o "$prefix/dlopen_version" "$src/tests/conformance/dlopen_version.c" -I"$prefix/include" -ldl
"$prefix/dlopen_version" "$prefix/lib/libpipe.so.$major"
echo "install checks passed"
