#!/usr/bin/env bash
# Install a built kvferry into a temporary prefix and build a small consumer
# against it twice: with find_package(kvferry) (shared and static targets)
# and with a plain compiler line from pkg-config (shared and static).
#
# usage: run.sh BUILD_DIR [C_COMPILER] [EXTRA_FLAGS]
#   EXTRA_FLAGS go to every compile and link (the build's sanitizer flags, so
#   a sanitized library links into the consumer).
set -euo pipefail

build=${1:?usage: run.sh BUILD_DIR [C_COMPILER] [EXTRA_FLAGS]}
cc=${2:-cc}
flags=${3:-}
cmake=${CMAKE:-cmake}
here=$(cd "$(dirname "$0")" && pwd)

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

step() { printf '== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

step "install into $prefix"
"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "cmake --install"; }

for h in kvferry.h status.h version.h geometry.h copy.h device.h; do
  [[ -f $prefix/include/kvferry/$h ]] || fail "header kvferry/$h was not installed"
done
if find "$prefix/include" -name '*.h' | xargs grep -l '#include "' >/dev/null 2>&1; then
  fail "an installed header includes a private (quoted) header"
fi

pc=$(find "$prefix" -name kvferry.pc | head -n 1)
[[ -n $pc ]] || fail "kvferry.pc was not installed"
libdir=$(dirname "$(dirname "$pc")")
so=$(find "$libdir" -maxdepth 1 -name 'libkvferry.so.*' -type f | head -n 1)
[[ -n $so && -f $libdir/libkvferry.a ]] || fail "libkvferry.so.* or libkvferry.a missing in $libdir"

if [[ -x $prefix/bin/kvferry ]]; then
  step "installed kvferry CLI"
  # No LD_LIBRARY_PATH: the install RPATH must find libkvferry.so.
  env -u LD_LIBRARY_PATH "$prefix/bin/kvferry" version || fail "installed bin/kvferry does not run"
fi

step "exported symbols of $(basename "$so")"
# Only the kvf_ API may be visible: no internal helpers, no static CUDA
# runtime leaking out to interpose on the application's own.
syms=$(nm -D --defined-only "$so")
leaked=$(awk '$2 ~ /^[TDBRVWi]$/ && $3 !~ /^kvf_/ && $3 !~ /^_(init|fini)$/ {print $3}' <<<"$syms")
[[ -z $leaked ]] || fail "libkvferry.so exports non-kvf symbols: $(head -n 20 <<<"$leaked" | tr '\n' ' ')"
grep -q ' T kvf_version$' <<<"$syms" || fail "kvf_version is not exported"
if grep -q ' T kvf_fail$' <<<"$syms"; then fail "internal kvf_fail is exported"; fi

step "find_package(kvferry)"
"$cmake" -S "$here" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_BUILD_TYPE=Debug \
  >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; fail "configuring the consumer"; }
"$cmake" --build "$tmp/cmake-build" -j2 >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "building the consumer"; }
"$tmp/cmake-build/consumer_shared" || fail "consumer_shared (find_package, kvferry::kvferry)"
"$tmp/cmake-build/consumer_static" || fail "consumer_static (find_package, kvferry::kvferry_static)"

step "pkg-config kvferry"
export PKG_CONFIG_PATH="$(dirname "$pc")${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
pkg-config --exists --print-errors kvferry || fail "pkg-config cannot read kvferry.pc"
pclibdir=$(pkg-config --variable=libdir kvferry)
[[ $(cd "$pclibdir" && pwd -P) == $(cd "$libdir" && pwd -P) ]] || fail "kvferry.pc libdir $pclibdir is not $libdir"
# shellcheck disable=SC2046,SC2086
"$cc" $flags -std=c11 -Wall -Wextra -Werror -pedantic "$here/consumer.c" -o "$tmp/pc_shared" \
  $(pkg-config --cflags --libs kvferry) -Wl,-rpath,"$pclibdir" || fail "cc with pkg-config --cflags --libs"
"$tmp/pc_shared" || fail "pc_shared (pkg-config, shared)"
# Static: the archive in place of -lkvferry, plus Libs.private and Requires.private.
static_libs=$(pkg-config --static --libs kvferry | sed "s#-lkvferry\\b#$pclibdir/libkvferry.a#")
# shellcheck disable=SC2046,SC2086
"$cc" $flags -std=c11 -Wall -Wextra -Werror -pedantic "$here/consumer.c" -o "$tmp/pc_static" \
  $(pkg-config --cflags kvferry) $static_libs || fail "cc with pkg-config --static --libs"
"$tmp/pc_static" || fail "pc_static (pkg-config, static)"

step "ok"
