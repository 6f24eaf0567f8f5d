#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (coverage, AddressSanitizer and
# UndefinedBehaviorSanitizer) in build-fuzz/ and runs each for LIBPIPE_FUZZ_SECONDS (default 30)
# from its seed corpus in tests/fuzz/corpus/<target>/, one target per core at a time. Fails if any
# finds an input, leaving it in build-fuzz/findings/; add it to the seed corpus and to a unit test
# once fixed.
#   scripts/fuzz.sh [TARGET...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$LIBPIPE_ROOT/scripts/install-deps.sh"
build=${LIBPIPE_FUZZ_BUILD:-$LIBPIPE_ROOT/build-fuzz}
seconds=${LIBPIPE_FUZZ_SECONDS:-30}
targets=("$@")
((${#targets[@]})) || targets=(fuzz_safetensors fuzz_checkpoint_index fuzz_split_point fuzz_model_archive fuzz_wire_message fuzz_dlpack_check)

CC=clang CXX=clang++ cmake -S "$LIBPIPE_ROOT" -B "$build" -G Ninja -DLIBPIPE_PYTHON="$LIBPIPE_PYTHON" \
  -DLIBPIPE_FUZZ=ON >/dev/null
cmake --build "$build" --target "${targets[@]}"

mkdir -p "$build/findings"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# One target per core at a time: each is one single-threaded process, so on a 2-core machine two run side by side
# for the same fuzzing time each, and the step takes half as long (CI's budget is wall-clock time).
fuzz_one() {
  local t=$1 seeds=$LIBPIPE_ROOT/tests/fuzz/corpus/$1
  local work=$build/corpus/$1  # grows across runs on this machine; the seeds stay as committed
  mkdir -p "$work"
  "$build/tests/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$build/findings/$t-" "$work" "$seeds" 2>"$build/$t.log"
}
slots=$(nproc)
failed=()
for ((i = 0; i < ${#targets[@]}; i += slots)); do
  batch=("${targets[@]:i:slots}")
  pids=()
  for t in "${batch[@]}"; do
    echo "fuzz: $t for ${seconds}s"
    fuzz_one "$t" &
    pids+=($!)
  done
  for j in "${!batch[@]}"; do
    t=${batch[j]}
    if wait "${pids[j]}"; then
      grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$build/$t.log" | sed "s/^/  $t /"
    else
      tail -n 60 "$build/$t.log"
      echo "fuzz: $t found a failing input (in $build/findings/)"
      failed+=("$t")
    fi
  done
done
((${#failed[@]} == 0)) || exit 1
echo "fuzz: no findings"
