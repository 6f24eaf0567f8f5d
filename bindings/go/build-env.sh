# Go build environment for building against the libpipe installed at PREFIX. Sourced (bash) by
# bindings/go/run-tests.sh and examples/go/run.sh with PREFIX and WORKDIR set (absolute paths).
#
# Why LIBPIPE_GO_INSTALL_ID: Go's build cache keys a cgo/SWIG package on its own files (the
# .swig, the .go files), the CGO_* environment variables, the #cgo directives and the compiler's
# identity, but NOT on what `#cgo pkg-config: libpipe` prints (pkg-config runs inside the build
# step, after the cache lookup: cmd/go's buildActionID) and NOT on any header outside the
# package: neither cgo's #include nor SWIG's %include "pipe/pipe.h" is tracked (`go help cache`:
# "the build cache does not detect changes to C libraries imported with cgo"). So after
# libpipe is upgraded, or PKG_CONFIG_PATH points at another install, `go build`/`go test`
# silently reuse internal/capi as built from the OLD header: its constants (PIPE_VERSION_*,
# which is how TestVersionMatchesHeader saw 0.2.0 against a 0.3.0 library), its struct
# accessors and the -L flags recorded for the link all come from the old install.
#
# The fix keys the cache on the install: CGO_CPPFLAGS (which is part of the cache key) gets a
# -D whose value is a hash of pipe.h as the C compiler sees it (preprocessed with pkg-config's
# flags, so the installed pipe.h, every header it includes such as dlpack/dlpack.h, and their
# paths) together with pkg-config's --cflags and --libs. A changed header or another PREFIX gives
# another key and a rebuild; the same install hits the shared cache, so warm runs stay fast. The
# macro is never used by any code. Only cgo packages are affected (runtime/cgo rebuilds once per
# install, a second). Go's cache directory itself stays shared ($(go env GOCACHE)): a cache per
# WORKDIR would rebuild the standard library for -race on every clean WORKDIR, and would still
# go stale if the install changed between two runs with the same WORKDIR.

: "${PREFIX:?build-env.sh: PREFIX is not set}" "${WORKDIR:?build-env.sh: WORKDIR is not set}"

for tool in go swig pkg-config; do
  command -v "$tool" >/dev/null || { echo "${0##*/}: $tool is not installed" >&2; exit 1; }
done
[ -f "$PREFIX/lib/pkgconfig/libpipe.pc" ] || { echo "${0##*/}: no libpipe.pc under $PREFIX/lib/pkgconfig" >&2; exit 1; }

export PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export CGO_ENABLED=1
# Nothing is downloaded: the modules have no dependencies but each other (a replace directive).
export GOTOOLCHAIN=local GOPROXY=off GOFLAGS="${GOFLAGS:+$GOFLAGS }-buildvcs=false"
export GOTMPDIR="$WORKDIR/tmp"
mkdir -p "$GOTMPDIR"
# The shared cache where Go has one (see above); under WORKDIR only when Go has none (no HOME).
if [ -z "$(go env GOCACHE 2>/dev/null || true)" ]; then export GOCACHE="$WORKDIR/gocache"; fi
if [ -z "$(go env GOPATH 2>/dev/null || true)" ]; then export GOPATH="$WORKDIR/gopath"; fi

libpipe_go_install_id() {
  local cc cflags libs
  read -ra cc <<<"$(go env CC)"
  cflags=$(pkg-config --cflags libpipe)
  libs=$(pkg-config --libs libpipe)
  {
    echo "cflags: $cflags"
    echo "libs: $libs"
    # shellcheck disable=SC2086 # flags are words
    printf '#include <pipe/pipe.h>\n' | "${cc[@]}" -E ${CGO_CPPFLAGS:-} $cflags -x c -
  } | sha256sum | cut -c1-32
}
# Drop a key an enclosing run already added (the scripts may call each other or be nested).
cppflags=()
for flag in ${CGO_CPPFLAGS:-}; do
  case "$flag" in -DLIBPIPE_GO_INSTALL_ID=*) ;; *) cppflags+=("$flag") ;; esac
done
CGO_CPPFLAGS="${cppflags[*]}"
LIBPIPE_GO_INSTALL_ID=$(libpipe_go_install_id)
export CGO_CPPFLAGS="${CGO_CPPFLAGS:+$CGO_CPPFLAGS }-DLIBPIPE_GO_INSTALL_ID=$LIBPIPE_GO_INSTALL_ID"
unset cppflags flag
