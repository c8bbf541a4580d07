#!/bin/sh
# Prints, one per line and sorted, the packages (dpkg) that own the shared libraries the given
# binaries load, as `ldd` resolves them. The image's build stage runs it on the binaries it built,
# and the runtime stage installs exactly this list: the runtime libraries are derived from the
# binaries, not written down by hand, so the list follows the distribution (bookworm's
# libgrpc++1.51, Ubuntu 24.04's libgrpc++1.51t64) and every library the code starts to link.
#
#   deploy/runtime-packages.sh /out/hsx-server /out/hsx-dump ...
#
# Fails (status 1, naming the library) when a library is not found or belongs to no package:
# the runtime stage could not install it. POSIX sh: it runs in minimal base images.
set -eu
[ "$#" -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for b in "$@"; do
  [ -x "$b" ] || { echo "runtime-packages.sh: $b: not an executable" >&2; exit 1; }
  ldd "$b" >"$tmp/ldd" || { echo "runtime-packages.sh: ldd $b failed" >&2; exit 1; }
  # "libfoo.so.1 => /path/libfoo.so.1 (0x...)"; the vdso and the loader have no "=> /".
  if grep -q "=> not found" "$tmp/ldd"; then
    grep "=> not found" "$tmp/ldd" | sed "s|^|runtime-packages.sh: $b: |" >&2
    exit 1
  fi
  awk '$2 == "=>" && $3 ~ /^\// { print $3 }' "$tmp/ldd" >>"$tmp/libs"
done

for lib in $(sort -u "$tmp/libs"); do
  # dpkg records the path it unpacked, which on a merged-/usr system may be the /lib or the
  # /usr/lib spelling of what ldd printed: try both, and the fully resolved path.
  real=$(readlink -f "$lib")
  owner=""
  for candidate in "$lib" "$real" "${lib#/usr}" "/usr${lib#/usr}" "${real#/usr}" "/usr${real#/usr}"; do
    owner=$(dpkg-query -S "$candidate" 2>/dev/null | head -n 1 | cut -d: -f1)
    [ -n "$owner" ] && break
  done
  if [ -z "$owner" ]; then
    echo "runtime-packages.sh: $lib ($real) belongs to no installed package" >&2
    exit 1
  fi
  echo "$owner" >>"$tmp/packages"
done
sort -u "$tmp/packages"
