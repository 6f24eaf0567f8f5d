#!/usr/bin/env bash
# Compares libpipe.so's ABI (its functions and the public types of pipe/pipe.h, read by abidw from
# the debug information of the C ABI layer) with the checked-in baseline capi/libpipe.abi.xz.
# Added functions are fine and reported; a removed function, or any change to an existing
# function's signature or to a public struct, fails: such changes are made deliberately, with
# scripts/update-abi-baseline.sh (and a new PIPE_VERSION_MAJOR when they break callers).
#   check_abi.sh LIBPIPE.so HEADERS_DIR BASELINE.abi.xz
set -uo pipefail
lib=$1 headers=$2 baseline=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
xz -dc "$baseline" >"$work/baseline.abi" || { echo "cannot read $baseline"; exit 1; }
abidw --headers-dir "$headers" --drop-private-types --no-corpus-path --out-file "$work/current.abi" "$lib" ||
  { echo "abidw failed"; exit 1; }
# Both corpora are already limited to the public headers by abidw; the baseline records the
# absolute paths of the checkout that wrote it, so no header folder is given here.
abidiff "$work/baseline.abi" "$work/current.abi" >"$work/report"
rc=$?
cat "$work/report"
# abidiff's status bits: 1 error, 2 usage error, 4 ABI change, 8 incompatible ABI change.
if (( rc & 3 )); then echo "abidiff could not compare (status $rc)"; exit 1; fi
if (( rc & 8 )); then echo "incompatible ABI change against $baseline"; exit 1; fi
summary=$(grep -E '^(Functions|Variables) changes summary' "$work/report" || true)
if grep -qE '[1-9][0-9]* (Removed|Changed)' <<<"$summary"; then
  echo "existing functions or types changed against $baseline: update the baseline only if this is intended"
  exit 1
fi
echo "ABI compatible with $baseline"
