#!/usr/bin/env bash
# The main job on the embedded default, on the CPU: generate the tiny Kimi-K2-
# format model and inspect it. (Later stages serve it and extract from it.)
#
# Environment: HSX_DEMO_DIR (default ~/.cache/hsx/demo) holds the generated model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
bin="${HSX_BUILD_DIR:-build}/bin"
demo="${HSX_DEMO_DIR:-$HOME/.cache/hsx/demo}"
model="$demo/tiny"

rm -rf "$model"
mkdir -p "$demo"
echo "== generating the tiny model (Kimi-K2 layout, INT4 routed experts) in $model"
"$bin/hsx-make-model" --preset tiny --seed 0 --shard_size 1MB --out "$model"
echo
echo "== hsx-inspect --model $model --tp 2"
"$bin/hsx-inspect" --model "$model" --tp 2
echo
echo "== one routed expert, dequantized to float32"
"$bin/hsx-inspect" --model "$model" --dequant model.layers.1.mlp.experts.0.up_proj \
  --out "$demo/expert0_up.safetensors"
echo "wrote $demo/expert0_up.safetensors"
