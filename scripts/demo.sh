#!/usr/bin/env bash
# The main job on the embedded default, on the CPU: generate the tiny Kimi-K2-
# format model, extract the hidden states of the bundled samples with
# hsx-dump (in-process), and summarise what was written.
#
# Environment: HSX_DEMO_DIR (default ~/.cache/hsx/demo) holds the model and output.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
bin="${HSX_BUILD_DIR:-build}/bin"
demo="${HSX_DEMO_DIR:-$HOME/.cache/hsx/demo}"
model="$demo/tiny"
out="$demo/hidden_states"
samples=scripts/demo/samples.jsonl

rm -rf "$model" "$out"
mkdir -p "$demo"
echo "== generating the tiny model (Kimi-K2 layout, INT4 routed experts) in $model"
"$bin/hsx-make-model" --preset tiny --seed 0 --out "$model"
"$bin/hsx-inspect" --model "$model" | sed -n '1,4p;/eagle3/p;/^bytes/p'
echo
echo "== extracting $(wc -l <"$samples") samples with hsx-dump (capture eagle3, bf16)"
"$bin/hsx-dump" --model "$model" --input "$samples" --out "$out" --capture eagle3 --final-norm
echo
echo "== what was written"
python3 - "$out" <<'PY'
import json, os, struct, sys
out = sys.argv[1]
files = sorted(os.listdir(out), key=lambda n: int(n[3:].split(".")[0]))
total_bytes = total_tokens = 0
for name in files:
    with open(os.path.join(out, name), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    meta = header.pop("__metadata__")
    hs = header["hidden_states"]
    total_tokens += hs["shape"][0]
    total_bytes += os.path.getsize(os.path.join(out, name))
    if name in files[:3] or name == files[-1]:
        print(f"  {name:22} id={meta['sample_id']:9} hidden_states {hs['dtype']} {hs['shape']}"
              f"  capture_ids={meta['capture_ids']}  keys={sorted(header)}")
print(f"  ... {len(files)} files, {total_tokens} tokens, {total_bytes / 2**20:.1f} MiB in {out}")
PY
