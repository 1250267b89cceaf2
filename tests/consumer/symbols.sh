#!/usr/bin/env bash
# The symbols of each library, against where its code belongs (docs/design.md,
# "Source tree"): kvferryd's internals (host/server) are kvferry_server and
# nothing of them may be in libkvferry, shared or static.
#
# usage: symbols.sh SERVER_DIR LIBKVFERRY_SO LIBKVFERRY_A [LIBKVFERRY_SERVER_A]
#   SERVER_DIR  host/server in the source tree. Its headers name the server's
#               functions; their kvf_<word>_ prefixes (kvf_server_, kvf_l1_,
#               ...) are the server's own, so no libkvferry symbol may start
#               with one. Its sources name the object files (archive members)
#               and the FILE symbols that must not appear in libkvferry.
#
# libkvferry.so   exports only kvf_ symbols (kvf_version among them, not the
#                 internal kvf_fail), and its full symbol table, local symbols
#                 included, has no server function, no symbol with a server
#                 prefix and no FILE symbol of a server source
# libkvferry.a    the same for every member, and no member built from a server
#                 source
# libkvferry_server.a
#                 defines only kvf_ global symbols, defines every function the
#                 server headers declare, and none that libkvferry.a defines
set -euo pipefail

usage='usage: symbols.sh SERVER_DIR LIBKVFERRY_SO LIBKVFERRY_A [LIBKVFERRY_SERVER_A]'
server_dir=${1:?$usage}
so=${2:?$usage}
archive=${3:?$usage}
server_archive=${4:-}

fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
list() { head -n 20 <<<"$1" | tr '\n' ' '; }

# --- what the server is, from its sources
shopt -s nullglob
headers=("$server_dir"/*.h)
sources=("$server_dir"/*.c "$server_dir"/*.cu "$server_dir"/*.cpp)
shopt -u nullglob
((${#headers[@]} && ${#sources[@]})) || fail "no headers or sources in $server_dir"
# Functions the headers declare: a line opening at column 0 with the return
# type or the name itself (static inline helpers aside), the name right
# before its '('.
functions=$(grep -hE '^([A-Za-z_][^#(]*[ *])?kvf_[A-Za-z0-9_]+\(' "${headers[@]}" | grep -vE '^static' |
  sed -E 's/^(.*[ *])?(kvf_[A-Za-z0-9_]+)\(.*$/\2/' | sort -u)
[[ -n $functions ]] || fail "found no kvf_ function declared in $server_dir/*.h"
prefixes=$(sed -E 's/^(kvf_[A-Za-z0-9]+_).*$/\1/' <<<"$functions" | sort -u)
prefix_re="^($(paste -sd '|' <<<"$prefixes"))"
function_re="^($(paste -sd '|' <<<"$functions"))$"
objects=$(for s in "${sources[@]}"; do basename "$s"; done | sort -u)
printf 'server: %d functions in %d headers, prefixes %s; sources %s\n' "$(wc -l <<<"$functions")" \
  "${#headers[@]}" "$(tr '\n' ' ' <<<"$prefixes")" "$(tr '\n' ' ' <<<"$objects")"

# server_names NAME_LIST: the names in it that belong to the server
server_names() { awk -v p="$prefix_re" -v f="$function_re" '$0 ~ p || $0 ~ f' <<<"$1"; }

# --- libkvferry.so
for f in "$so" "$archive" ${server_archive:+"$server_archive"}; do [[ -f $f ]] || fail "$f does not exist"; done
echo "== $so"
dynamic=$(nm -D --defined-only "$so")
leaked=$(awk '$2 ~ /^[TDBRVWi]$/ && $3 !~ /^kvf_/ && $3 !~ /^_(init|fini)$/ {print $3}' <<<"$dynamic")
# Only the kvf_ API may be visible: no internal helpers, no static CUDA
# runtime leaking out to interpose on the application's own.
[[ -z $leaked ]] || fail "$so exports non-kvf symbols: $(list "$leaked")"
grep -q ' T kvf_version$' <<<"$dynamic" || fail "kvf_version is not exported"
if grep -q ' T kvf_fail$' <<<"$dynamic"; then fail "internal kvf_fail is exported"; fi
# The full table: hidden functions are local symbols here, still named.
full=$(nm "$so" 2>/dev/null | awk '{print $NF}') || true
grep -qx 'kvf_fail' <<<"$full" || fail "$so has no full symbol table (stripped?): the checks below would see nothing"
found=$(server_names "$full")
[[ -z $found ]] || fail "$so contains server symbols: $(list "$found")"
files=$(readelf -sW "$so" | awk '$4 == "FILE" {print $8}' | sort -u)
found=$(grep -Fxf <(printf '%s\n' "$objects") <<<"$files" || true)
[[ -z $found ]] || fail "$so was linked from server sources: $(list "$found")"

# --- libkvferry.a
echo "== $archive"
all=$(nm -A "$archive" 2>/dev/null | awk 'NF >= 2 {print $NF}')
grep -qx 'kvf_fail' <<<"$all" || fail "$archive lists no kvf_fail: the checks below would see nothing"
found=$(server_names "$all")
[[ -z $found ]] || fail "$archive contains server symbols (defined or referenced): $(list "$found")"
members=$(ar t "$archive")
found=$(grep -Fxf <(sed 's/$/.o/' <<<"$objects") <<<"$members" || true)
[[ -z $found ]] || fail "$archive has members built from server sources: $(list "$found")"

# --- libkvferry_server.a
if [[ -n $server_archive ]]; then
  echo "== $server_archive"
  globals=$(nm -g --defined-only "$server_archive" | awk 'NF == 3 {print $3}' | sort -u)
  stray=$(grep -v '^kvf_' <<<"$globals" || true)
  [[ -z $stray ]] || fail "$server_archive defines non-kvf global symbols: $(list "$stray")"
  defined=$(nm -g --defined-only "$server_archive" | awk 'NF == 3 && $2 == "T" {print $3}' | sort -u)
  missing=$(comm -23 <(printf '%s\n' "$functions") <(printf '%s\n' "$defined"))
  [[ -z $missing ]] || fail "$server_archive does not define these functions its headers declare: $(list "$missing")"
  twice=$(comm -12 <(printf '%s\n' "$globals") \
    <(nm -g --defined-only "$archive" 2>/dev/null | awk 'NF == 3 {print $3}' | sort -u))
  [[ -z $twice ]] || fail "both $server_archive and $archive define: $(list "$twice")"
fi
echo "== symbols ok"
