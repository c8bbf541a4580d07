#!/usr/bin/env python3
"""Bytes per token on disk for each --dtype and capture preset: computed from the format
(docs/formats.md) and measured from hsx-dump's files on a generated model.

Computed, per token: the captured rows (one per capture id, plus one for the final norm), each
RowBytes(dtype, H) = 2H (bf16, fp16), 4H (fp32) or H + 4 (fp8: H e4m3 bytes and a float32 scale),
plus token_ids and loss_mask (int64 each, 16 B). Measured: the total size of the sample files
hsx-dump --model wrote, over the tokens; the difference is each file's safetensors header and
metadata, spread over its tokens. The Kimi-K2 column (H = 7168, N = 61) is computed only.

    ~/.cache/hsx/venv/bin/python bench/bytes_per_token.py [--bin-dir build/bin] [--preset tiny]
        [--samples 8] [--tokens 512]
"""

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_util import run  # noqa: E402

DTYPES = ["bf16", "fp16", "fp32", "fp8"]
# name -> (hsx-dump flags, rows per token as a function of N: capture ids + final norm)
PRESETS = {
    "eagle3 --final-norm": (["--capture", "eagle3", "--final-norm"], 5),
    "eagle3": (["--capture", "eagle3"], 4),
    "speculators": (["--capture", "speculators"], 4),
    "specforge": (["--capture", "specforge"], 4),
    "modelopt": (["--capture", "modelopt"], 4),
}
KIMI_HIDDEN = 7168


def row_bytes(dtype, hidden):
    return {"bf16": 2 * hidden, "fp16": 2 * hidden, "fp32": 4 * hidden, "fp8": hidden + 4}[dtype]


def computed(dtype, rows, hidden):
    return rows * row_bytes(dtype, hidden) + 16  # token_ids and loss_mask, int64


def measure(bin_dir, model, inputs, out, flags, dtype):
    run([bin_dir / "hsx-dump", "--model", model, "--input", inputs, "--out", out, "--dtype", dtype,
         "--progress", "none", *flags])
    files = list(out.glob("hs_*.safetensors"))
    return sum(f.stat().st_size for f in files)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin-dir", type=Path, default=REPO / "build" / "bin")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-bytes-"))
    try:
        model = work / "model"
        run([args.bin_dir / "hsx-make-model", "--preset", args.preset, "--seed", "0", "--out", model])
        config = json.loads((model / "config.json").read_text())
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        rng = random.Random(0)
        inputs = work / "in.jsonl"
        inputs.write_text("".join(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(args.tokens)],
                                              "loss_mask": [1] * args.tokens}) + "\n"
                                  for _ in range(args.samples)))
        tokens = args.samples * args.tokens
        print(f"{args.preset} (H = {hidden}), {args.samples} samples of {args.tokens} tokens; "
              f"Kimi-K2 (H = {KIMI_HIDDEN}) computed")
        print("| preset | dtype | rows/token | computed B/token | measured B/token | measured / computed "
              "| Kimi-K2 computed B/token | / eagle3 --final-norm bf16 |")
        print("|---|---|---|---|---|---|---|---|")
        base = computed("bf16", 5, KIMI_HIDDEN)
        for name, (flags, rows) in PRESETS.items():
            for dtype in DTYPES:
                out = work / f"out-{len(list(work.iterdir()))}"
                size = measure(args.bin_dir, model, inputs, out, flags, dtype)
                shutil.rmtree(out)
                want, got, kimi = computed(dtype, rows, hidden), size / tokens, computed(dtype, rows, KIMI_HIDDEN)
                print(f"| {name} | {dtype} | {rows} | {want} | {got:.1f} | {got / want:.4f} | {kimi:,} "
                      f"| {kimi / base:.3f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
