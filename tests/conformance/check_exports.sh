#!/usr/bin/env bash
# libpipe.so exports the C ABI and nothing else: every defined dynamic symbol starts with pipe_
# (LibTorch, libstdc++ and the C++ runtime stay private; the version node LIBPIPE_0 is not a
# symbol), and the SONAME carries the ABI major.
set -euo pipefail
lib=$1
major=$2
symbols=$(nm -D --defined-only "$lib" | awk '$2 != "A" {print $3}' | sed 's/@.*//' | sort -u)
[ -n "$symbols" ] || { echo "no exported symbols found in $lib"; exit 1; }
others=$(grep -v '^pipe_' <<<"$symbols" || true)
if [ -n "$others" ]; then
  echo "libpipe.so exports symbols outside the C ABI:"
  echo "$others" | head -20
  exit 1
fi
soname=$(objdump -p "$lib" | awk '/SONAME/ {print $2}')
[ "$soname" = "libpipe.so.$major" ] || { echo "SONAME is '$soname', expected libpipe.so.$major"; exit 1; }
echo "$(wc -l <<<"$symbols") symbols exported, all pipe_*; SONAME $soname"
