#!/bin/sh
# stage-model.sh SRC DST: copies the checkpoint directory SRC (shared storage: NFS, Lustre, a
# mounted bucket) to DST on this node's local disk and verifies the copy before it is used.
# hsx-server memory-maps the checkpoint's shards, so every page it touches is read from where
# DST lives: local NVMe loads far faster than network storage.
#
# SRC must hold hsx-full-digest.txt, written once where the checkpoint is published:
#   hsx-inspect --model SRC --full-digest > SRC/hsx-full-digest.txt
# The copy goes to DST.partial; `hsx-inspect --model DST.partial --full-digest` (which opens and
# validates the checkpoint, then hashes config.json, the index and every shard byte) must print
# the same digest; only then is DST.partial renamed to DST. A DST whose digest file matches SRC's
# is kept as it is (a restarted pod does not copy again); a DST from another checkpoint is
# replaced. On any failure DST is untouched and the script exits non-zero, naming what failed.
# Environment: HSX_STAGE_JOBS (parallel copies, default 8), HSX_INSPECT (default hsx-inspect).
set -eu

if [ "$#" -ne 2 ]; then
  echo "usage: stage-model.sh SRC DST" >&2
  exit 2
fi
src=${1%/}
dst=${2%/}
jobs=${HSX_STAGE_JOBS:-8}
inspect=${HSX_INSPECT:-hsx-inspect}
digest_file=hsx-full-digest.txt

fail() {
  echo "stage-model: $*" >&2
  exit 1
}

[ -d "$src" ] || fail "$src: no such directory (the shared model volume)"
[ -f "$src/$digest_file" ] ||
  fail "$src/$digest_file: missing; write it once with: hsx-inspect --model $src --full-digest > $src/$digest_file"
want=$(cut -d' ' -f1 "$src/$digest_file")
printf '%s\n' "$want" | grep -Eq '^[0-9a-f]{16}$' ||
  fail "$src/$digest_file, line 1: '$want' is not an XXH64 digest (16 hex digits)"

if [ -f "$dst/$digest_file" ] && [ "$(cut -d' ' -f1 "$dst/$digest_file")" = "$want" ]; then
  echo "stage-model: $dst already holds checkpoint $want"
  exit 0
fi

start=$(date +%s)
rm -rf "$dst.partial"
mkdir -p "$dst.partial"
echo "stage-model: copying $src to $dst.partial ($jobs at a time)"
# One cp per file, $jobs at once: network storage gives more throughput to parallel streams.
(cd "$src" && find . -type f ! -name "$digest_file" -print0 |
  xargs -0 -r -n 1 -P "$jobs" cp --parents -t "$dst.partial" --) || {
  rm -rf "$dst.partial"
  fail "copying $src to $dst.partial failed (above: the file and why)"
}
copied=$(date +%s)

echo "stage-model: verifying $dst.partial with $inspect --full-digest"
report=$("$inspect" --model "$dst.partial" --full-digest) || {
  rm -rf "$dst.partial"
  fail "$dst.partial: $inspect --model --full-digest failed (above: why; a damaged or incomplete copy)"
}
got=${report%% *}
if [ "$got" != "$want" ]; then
  rm -rf "$dst.partial"
  fail "$dst.partial: digest $got, but $src/$digest_file says $want (copy damaged, or SRC changed since the digest was written)"
fi
cp "$src/$digest_file" "$dst.partial/$digest_file"

# Swap in: DST is either the old copy or the new, complete one.
if [ -e "$dst" ]; then
  rm -rf "$dst.old"
  mv "$dst" "$dst.old"
fi
mv "$dst.partial" "$dst"
rm -rf "$dst.old"
end=$(date +%s)
echo "stage-model: $dst holds checkpoint $want ($(du -sh "$dst" | cut -f1); copy $((copied - start)) s, verify $((end - copied)) s)"
