#!/usr/bin/env python3
"""Tensor-parallel scaling on the CPU backend (not a test): hsx-dump --tp 1 against --tp 2
with the same total thread count, same samples, in one run (runs interleaved, best of N).

On a 2-core machine TP 2 cannot be faster than TP 1 (both use both cores); the ratio
measures what the split costs: two all-reduces per layer and the smaller per-rank GEMMs.

    ~/.cache/hsx/venv/bin/python bench/tp_scaling.py [--bin-dir build/bin] [--threads 2]
"""

import argparse
import json
import random
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RATE = re.compile(r"(\d+) tokens, .* in ([\d.]+) s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", default=str(REPO / "build" / "bin"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    bin_dir = Path(args.bin_dir)
    model = Path.home() / ".cache" / "hsx" / "bench" / "small" / "seed0"
    if not (model / "config.json").exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([bin_dir / "hsx-make-model", "--preset", "small", "--seed", "0", "--out", model], check=True)
    work = Path(tempfile.mkdtemp(prefix="hsx-tp-bench-"))
    try:
        rng = random.Random(0)
        with open(work / "in.jsonl", "w") as f:
            for _ in range(args.samples):
                n = min(892, max(71, int(rng.lognormvariate(5.6, 0.6))))
                f.write(json.dumps({"input_ids": [rng.randrange(32000) for _ in range(n)]}) + "\n")
        best = {}
        for _ in range(args.runs):
            for tp in (1, 2):
                out = work / f"out{tp}"
                shutil.rmtree(out, ignore_errors=True)
                proc = subprocess.run([bin_dir / "hsx-dump", "--model", model, "--input", work / "in.jsonl", "--out",
                                       out, "--precision", "fp32", "--capture", "eagle3", "--threads",
                                       str(args.threads), "--tp", str(tp)], capture_output=True, text=True, check=True)
                tokens, seconds = RATE.search(proc.stdout).groups()
                rate = int(tokens) / float(seconds)
                best[tp] = max(best.get(tp, 0), rate)
        print(f"small preset, {tokens} tokens, {args.threads} threads in all, best of {args.runs}")
        print(f"{'tp':>3} {'tokens/s':>10} {'ratio':>7}")
        for tp in (1, 2):
            print(f"{tp:>3} {best[tp]:>10.1f} {best[tp] / best[1]:>7.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
