#!/usr/bin/env bash
# The main job on the embedded default, on the CPU: generate the tiny Kimi-K2-
# format model, serve it with hsx-server on loopback, extract the bundled
# samples with hsx-dump --server, check the output with hsx-verify, train the
# example EAGLE-3 head for a few steps straight from the stream (the loss
# falls), stop the server (SIGTERM: it drains), and summarise what was written.
#
# Environment: HSX_DEMO_DIR (default ~/.cache/hsx/demo) holds the model and output;
# HSX_VENV (default ~/.cache/hsx/venv) the Python environment (torch) for training.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the demo runs: the four tools and the Python client's native receive path.
scripts/setup.sh --python --targets "hsx-make-model hsx-inspect hsx-server hsx-dump hsx-verify hsx_python_native"
venv="${HSX_VENV:-$HOME/.cache/hsx/venv}"
bin="${HSX_BUILD_DIR:-build}/bin"
demo="${HSX_DEMO_DIR:-$HOME/.cache/hsx/demo}"
model="$demo/tiny"
out="$demo/hidden_states"
samples=scripts/demo/samples.jsonl
log="$demo/server.log"

rm -rf "$model" "$out"
mkdir -p "$demo"
echo "== generating the tiny model (DeepSeek-V3 / Kimi-K2 architecture, INT4 routed experts) in $model"
"$bin/hsx-make-model" --preset tiny --seed 0 --out "$model"
"$bin/hsx-inspect" --model "$model" | sed -n '1,4p;/eagle3/p;/^bytes/p'

echo
echo "== starting hsx-server on 127.0.0.1 (log: $log)"
"$bin/hsx-server" --model "$model" --listen 127.0.0.1:0 2>"$log" &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
address=""
for _ in $(seq 1 300); do
  address=$(sed -n 's/.*hsx-server: listening on \([^ ]*\).*/\1/p' "$log" | head -n 1)
  grep -q "ready" "$log" && [[ -n "$address" ]] && break
  kill -0 "$server" 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
grep -q "ready" "$log" || { echo "hsx-server did not become ready"; cat "$log"; exit 1; }
echo "serving on $address"

echo
echo "== extracting $(wc -l <"$samples") samples with hsx-dump --server (capture eagle3 + final norm, bf16)"
"$bin/hsx-dump" --server "$address" --input "$samples" --out "$out" --capture eagle3 --final-norm

echo
echo "== hsx-verify"
"$bin/hsx-verify" "$out" --input "$samples"

echo
echo "== hsx-verify --for speculators (what speculators assumes of hs_{i}.safetensors)"
"$bin/hsx-verify" "$out" --input "$samples" --for speculators | tail -n 1

echo
echo "== training the example EAGLE-3 head from the stream (client/python/examples/train_eagle3_head.py)"
"$venv/bin/python" client/python/examples/train_eagle3_head.py --server "$address" --input "$samples" \
  --steps 24 --lr 3e-3 | sed -n '1,3p;$p'

echo
echo "== stopping the server (SIGTERM drains, then exits 0)"
kill -TERM "$server"
wait "$server"
trap - EXIT
tail -n 2 "$log"

echo
echo "== what was written"
"$venv/bin/python" - "$out" <<'PY'
import os, sys
import hsx  # the Python client's reader (client/python/hsx/files.py), not a copy of it
out = sys.argv[1]
files = sorted((n for n in os.listdir(out) if n.endswith(".safetensors")), key=lambda n: int(n[3:].split(".")[0]))
total_bytes = total_tokens = 0
for name in files:
    sample = hsx.read_sample(os.path.join(out, name))
    hs = sample["hidden_states"]
    total_tokens += hs.shape[0]
    total_bytes += os.path.getsize(os.path.join(out, name))
    if name in files[:3] or name == files[-1]:
        print(f"  {name:22} id={sample.sample_id:9} hidden_states {hs.dtype} {list(hs.shape)}"
              f"  capture_ids={sample.capture_ids}  keys={sorted(sample)}")
journal = sum(1 for _ in open(os.path.join(out, "manifest.jsonl")))
print(f"  ... {len(files)} files, {total_tokens} tokens, {total_bytes / 2**20:.1f} MiB, "
      f"{journal} journal lines in {out}")
PY
