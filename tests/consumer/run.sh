#!/usr/bin/env bash
# Build a small consumer against kvferry from the two places a consumer finds
# it, each time with find_package(kvferry) (shared and static targets) and
# with a plain compiler line from pkg-config (shared and static):
#   the build tree itself    BUILD/kvferryConfig.cmake, BUILD/kvferry-uninstalled.pc
#   an install               into a temporary prefix, then moved elsewhere:
#                            the package files must find the prefix themselves
# and checks the installed libraries' symbols (symbols.sh).
#
# usage: run.sh BUILD_DIR [C_COMPILER] [EXTRA_FLAGS]
#   EXTRA_FLAGS go to every compile and link (the build's sanitizer flags, so
#   a sanitized library links into the consumer).
set -euo pipefail

build=$(cd "${1:?usage: run.sh BUILD_DIR [C_COMPILER] [EXTRA_FLAGS]}" && pwd -P)
cc=${2:-cc}
flags=${3:-}
cmake=${CMAKE:-cmake}
here=$(cd "$(dirname "$0")" && pwd)
pkg_config_path=${PKG_CONFIG_PATH:-}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

step() { printf '== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
same_dir() { [[ $(cd "$1" && pwd -P) == $(cd "$2" && pwd -P) ]]; }

# consume NAME CMAKE_PREFIX CONFIG_DIR PC_DIR LIB_DIR UNINSTALLED
#   CMAKE_PREFIX goes to CMAKE_PREFIX_PATH and must lead find_package to
#   CONFIG_DIR; PC_DIR goes to PKG_CONFIG_PATH; LIB_DIR is where both must
#   take libkvferry from; UNINSTALLED (yes/no): whether pkg-config must have
#   read kvferry-uninstalled.pc.
consume() {
  local name=$1 cmake_prefix=$2 config_dir=$3 pc_dir=$4 lib_dir=$5 uninstalled=$6
  local out=$tmp/$name
  mkdir -p "$out"

  step "$name: find_package(kvferry), CMAKE_PREFIX_PATH=$cmake_prefix"
  "$cmake" -S "$here" -B "$out/cmake-build" -DCMAKE_PREFIX_PATH="$cmake_prefix" -DCMAKE_C_COMPILER="$cc" \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
    >"$out/configure.log" 2>&1 || { cat "$out/configure.log"; fail "$name: configuring the consumer"; }
  local found
  found=$(sed -n 's/^kvferry_DIR:[A-Z]*=//p' "$out/cmake-build/CMakeCache.txt")
  same_dir "$found" "$config_dir" || fail "$name: find_package took kvferry from $found, not $config_dir"
  "$cmake" --build "$out/cmake-build" -j2 >"$out/build.log" 2>&1 || { cat "$out/build.log"; fail "$name: building the consumer"; }
  local so
  so=$(env -u LD_LIBRARY_PATH ldd "$out/cmake-build/consumer_shared" | awk '$1 ~ /^libkvferry\.so/ {print $3}')
  if [[ -z $so ]] || ! same_dir "$(dirname "$so")" "$lib_dir"; then
    fail "$name: consumer_shared loads libkvferry from '$so', not $lib_dir"
  fi
  env -u LD_LIBRARY_PATH "$out/cmake-build/consumer_shared" || fail "$name: consumer_shared (find_package, kvferry::kvferry)"
  "$out/cmake-build/consumer_static" || fail "$name: consumer_static (find_package, kvferry::kvferry_static)"

  step "$name: pkg-config kvferry, PKG_CONFIG_PATH=$pc_dir"
  local PKG_CONFIG_PATH="$pc_dir${pkg_config_path:+:$pkg_config_path}"
  export PKG_CONFIG_PATH
  pkg-config --exists --print-errors kvferry || fail "$name: pkg-config cannot find kvferry"
  # --uninstalled: success when kvferry-uninstalled.pc was used.
  if pkg-config --uninstalled kvferry; then
    [[ $uninstalled == yes ]] || fail "$name: pkg-config read a kvferry-uninstalled.pc"
  else
    [[ $uninstalled == no ]] || fail "$name: pkg-config did not read $pc_dir/kvferry-uninstalled.pc"
  fi
  local pclibdir
  pclibdir=$(pkg-config --variable=libdir kvferry)
  same_dir "$pclibdir" "$lib_dir" || fail "$name: kvferry.pc libdir $pclibdir is not $lib_dir"
  # shellcheck disable=SC2046,SC2086
  "$cc" $flags -std=c11 -Wall -Wextra -Werror -pedantic "$here/consumer.c" -o "$out/pc_shared" \
    $(pkg-config --cflags --libs kvferry) -Wl,-rpath,"$pclibdir" || fail "$name: cc with pkg-config --cflags --libs"
  env -u LD_LIBRARY_PATH "$out/pc_shared" || fail "$name: pc_shared (pkg-config, shared)"
  # Static: the archive in place of -lkvferry, plus Libs.private and Requires.private.
  local static_libs
  static_libs=$(pkg-config --static --libs kvferry | sed "s#-lkvferry\\b#$pclibdir/libkvferry.a#")
  # shellcheck disable=SC2046,SC2086
  "$cc" $flags -std=c11 -Wall -Wextra -Werror -pedantic "$here/consumer.c" -o "$out/pc_static" \
    $(pkg-config --cflags kvferry) $static_libs || fail "$name: cc with pkg-config --static --libs"
  "$out/pc_static" || fail "$name: pc_static (pkg-config, static)"
}

# The build tree: the public headers from the source tree, version.h and the
# libraries from the build tree.
[[ -f $build/kvferryConfig.cmake && -f $build/kvferry-uninstalled.pc ]] ||
  fail "$build has no kvferryConfig.cmake or kvferry-uninstalled.pc"
[[ -f $build/libkvferry.a ]] || fail "$build/libkvferry.a is missing"
consume build-tree "$build" "$build" "$build" "$build" yes

# An install, into one prefix and used from another.
staged=$tmp/staged
prefix=$tmp/prefix
step "install into $staged, move it to $prefix"
"$cmake" --install "$build" --prefix "$staged" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "cmake --install"; }
mv "$staged" "$prefix"
if grep -rlI -e "$staged" -e "$build" "$prefix"; then
  fail "the installed files above name the install prefix or the build tree"
fi

for h in kvferry.h status.h version.h geometry.h copy.h device.h; do
  [[ -f $prefix/include/kvferry/$h ]] || fail "header kvferry/$h was not installed"
done
if find "$prefix/include" -name '*.h' | xargs grep -l '#include "' >/dev/null 2>&1; then
  fail "an installed header includes a private (quoted) header"
fi
if find "$prefix" -name 'kvferry-uninstalled.pc' | grep .; then
  fail "kvferry-uninstalled.pc was installed"
fi

pc=$(find "$prefix" -name kvferry.pc | head -n 1)
[[ -n $pc ]] || fail "kvferry.pc was not installed"
config=$(find "$prefix" -name kvferryConfig.cmake | head -n 1)
[[ -n $config ]] || fail "kvferryConfig.cmake was not installed"
libdir=$(dirname "$(dirname "$pc")")
so=$(find "$libdir" -maxdepth 1 -name 'libkvferry.so.*' -type f | head -n 1)
[[ -n $so && -f $libdir/libkvferry.a ]] || fail "libkvferry.so.* or libkvferry.a missing in $libdir"

if [[ -x $prefix/bin/kvferry ]]; then
  step "installed kvferry CLI"
  # No LD_LIBRARY_PATH: the install RPATH must find libkvferry.so.
  env -u LD_LIBRARY_PATH "$prefix/bin/kvferry" version || fail "installed bin/kvferry does not run"
fi

step "installed torch allocator module"
# Installed beside libkvferry.so.0, which its $ORIGIN run path must find.
module=$libdir/libkvferry_torch_alloc.so
[[ -f $module ]] || fail "libkvferry_torch_alloc.so was not installed in $libdir"
dep=$(env -u LD_LIBRARY_PATH ldd "$module" | awk '$1 ~ /^libkvferry\.so/ {print $3}')
if [[ -z $dep ]] || ! same_dir "$(dirname "$dep")" "$libdir"; then
  fail "the installed libkvferry_torch_alloc.so loads libkvferry from '$dep', not $libdir"
fi

step "symbols of the installed libraries"
"$here/symbols.sh" "$here/../../host/server" "$so" "$libdir/libkvferry.a" || fail "symbols of the installed libraries"

consume install "$prefix" "$(dirname "$config")" "$(dirname "$pc")" "$libdir" no

step "ok"
