#!/usr/bin/env bash
# Checks that every tracked source file is formatted as its formatter writes it: C and C++ with
# clang-format (.clang-format), Python with ruff (ruff.toml), Go with gofmt, Rust with rustfmt
# (bindings/rust/rustfmt.toml). Lists the files that differ and fails. `--fix` rewrites them
# instead. CI runs it (.ci/run); the pinned clang-format and ruff come from the virtualenv.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
"$LIBPIPE_ROOT/scripts/install-deps.sh"
cd "$LIBPIPE_ROOT"
fix=0
[ "${1:-}" = "--fix" ] && fix=1
bin=$(dirname "$LIBPIPE_PYTHON")
failed=0

mapfile -t c_files < <(git ls-files '*.c' '*.h' '*.cpp' '*.hpp' '*.h.in')
if ((fix)); then
  "$bin/clang-format" -i "${c_files[@]}"
else
  # clang-format exits non-zero when it would change a file: read its report first, so that pipefail
  # does not swallow the verdict.
  report=$("$bin/clang-format" --dry-run --Werror "${c_files[@]}" 2>&1 || true)
  changed=$(grep -o '^[^:]*:[0-9]*:[0-9]*: error' <<<"$report" | cut -d: -f1 | sort -u || true)
  [ -z "$changed" ] || { sed 's/^/check-format: clang-format would change /' <<<"$changed"; failed=1; }
fi

mapfile -t py_files < <(git ls-files '*.py')
if ((fix)); then
  "$bin/ruff" format -q "${py_files[@]}"
else
  "$bin/ruff" format --check "${py_files[@]}" || failed=1
fi

mapfile -t go_files < <(git ls-files '*.go')
if ((fix)); then
  gofmt -w "${go_files[@]}"
else
  out=$(gofmt -l "${go_files[@]}")
  [ -z "$out" ] || { echo "$out" | sed 's/^/check-format: gofmt would change /'; failed=1; }
fi

for crate in bindings/rust examples/rust text; do
  if ((fix)); then
    (cd "$crate" && cargo fmt --all)
  else
    (cd "$crate" && cargo fmt --all --check >/dev/null) || { echo "check-format: rustfmt would change $crate"; failed=1; }
  fi
done

if ((failed)); then
  echo "check-format: run scripts/check-format.sh --fix" >&2
  exit 1
fi
echo "check-format: all sources formatted"
