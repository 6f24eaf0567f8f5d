#!/usr/bin/env bash
# libpipe.so exports exactly the checked-in symbol list (capi/libpipe.symbols): the C ABI and
# nothing else (LibTorch, libstdc++ and the C++ runtime stay private), and its SONAME carries the
# ABI major. A new function means a deliberate update of the list (see README).
#   check_exports.sh LIBPIPE.so ABI_MAJOR SYMBOLS_FILE
set -euo pipefail
lib=$1 major=$2 expected=$3
# Defined dynamic symbols, without the version node (LIBPIPE_0, an absolute symbol).
actual=$(nm -D --defined-only "$lib" | awk '$2 != "A" {print $3}' | sed 's/@.*//' | sort -u)
if ! diff <(grep -v '^#' "$expected" | sort -u) <(echo "$actual") >/tmp/libpipe-exports.diff; then
  echo "exported symbols differ from $expected (< expected, > exported):"
  cat /tmp/libpipe-exports.diff
  exit 1
fi
others=$(grep -v '^pipe_' <<<"$actual" || true)
[ -z "$others" ] || { echo "symbols outside the C ABI: $others"; exit 1; }
soname=$(objdump -p "$lib" | awk '/SONAME/ {print $2}')
[ "$soname" = "libpipe.so.$major" ] || { echo "SONAME is '$soname', expected libpipe.so.$major"; exit 1; }
echo "$(wc -l <<<"$actual") symbols exported, exactly the checked-in list; SONAME $soname"
