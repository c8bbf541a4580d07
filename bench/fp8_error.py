#!/usr/bin/env python3
"""Error of --dtype fp8 (e4m3, a float32 scale per token per layer) against bf16 and fp32, on a
model's real activations: every capture id 0..N and the final norm, per layer.

For each preset (hsx-make-model --preset P --seed 0) the same random samples are dumped in process
(hsx-dump --model) three times, --dtype fp32, bf16 and fp8; the fp8 files are dequantized by
hsx.read_sample (e4m3 * scale in float32; dequantize=False, so no bf16 rounding on top) and compared
with the fp32 states (the reference) and with the bf16 ones. Per layer:

  rel L2      ||fp8 - ref|| / ||ref|| over the whole [T, H] tensor
  max abs     max |fp8 - ref|
  max rel     max |fp8 - ref| / |ref| over the values in e4m3's normal range (|ref| >= scale * 2^-6),
              whose bound is 2^-4 (3 mantissa bits, round to nearest)
  max/amax    max |fp8 - ref| / the row's largest |ref|, over all values (at most half an e4m3
              step of the row's top binade: 16 / 448 = 0.036)

and the same rel L2 for bf16 against fp32 (0 when the engine computes in bf16: the fp32 dump is
then bf16 widened).

    ~/.cache/hsx/venv/bin/python bench/fp8_error.py [--bin-dir build/bin] [--presets tiny,small]
        [--samples 16] [--max-tokens 256] [--precision bf16|fp32] [--work DIR]
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_util import run  # noqa: E402


def dump(bin_dir, model, inputs, out, dtype, layers, precision):
    capture = ",".join(str(i) for i in range(layers + 1))
    run([bin_dir / "hsx-dump", "--model", model, "--input", inputs, "--out", out, "--dtype", dtype,
         "--capture", capture, "--final-norm", "--precision", precision])


def layer_errors(ref, fp8, scales):
    """The four numbers for one [T, H] tensor."""
    ref = ref.astype(np.float64)
    err = np.abs(fp8.astype(np.float64) - ref)
    normal = np.abs(ref) >= scales.astype(np.float64) * 2.0 ** -6
    amax = np.abs(ref).max(axis=-1, keepdims=True)
    return {"rel_l2": float(np.linalg.norm(err) / np.linalg.norm(ref)),
            "max_abs": float(err.max()),
            "max_rel": float((err[normal] / np.abs(ref[normal])).max()),
            "max_over_amax": float((err / np.where(amax > 0, amax, 1)).max())}


def measure(hsx, bin_dir, work, preset, samples, max_tokens, precision):
    model = work / preset
    if not (model / "config.json").exists():
        run([bin_dir / "hsx-make-model", "--preset", preset, "--seed", "0", "--out", model])
    config = json.loads((model / "config.json").read_text())
    config = config.get("text_config", config)
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    rng = np.random.default_rng(0)
    inputs = work / f"{preset}.jsonl"
    for dtype in ("fp32", "bf16", "fp8"):  # a rerun in the same --work dumps afresh
        shutil.rmtree(work / f"{preset}-{dtype}", ignore_errors=True)
    inputs.write_text("".join(json.dumps({"input_ids": rng.integers(0, vocab, int(rng.integers(16, max_tokens))).tolist()})
                              + "\n" for _ in range(samples)))
    for dtype in ("fp32", "bf16", "fp8"):
        dump(bin_dir, model, inputs, work / f"{preset}-{dtype}", dtype, layers, precision)
    names = [f"capture {i}" for i in range(layers + 1)] + ["final norm"]
    per_layer = {n: {"ref": [], "fp8": [], "scales": [], "bf16": []} for n in names}
    for i in range(samples):
        f = f"hs_{i}.safetensors"
        ref = hsx.read_sample(work / f"{preset}-fp32" / f)
        b16 = hsx.read_sample(work / f"{preset}-bf16" / f)
        q = hsx.read_sample(work / f"{preset}-fp8" / f, dequantize=False)
        deq = q["hidden_states"].astype(np.float32) * q["hidden_states_scales"]
        fdeq = q["final_norm_hidden_states"].astype(np.float32) * q["final_norm_hidden_states_scales"]
        for l, name in enumerate(names[:-1]):
            per_layer[name]["ref"].append(np.asarray(ref["hidden_states"][:, l]))
            per_layer[name]["fp8"].append(deq[:, l])
            per_layer[name]["scales"].append(q["hidden_states_scales"][:, l])
            per_layer[name]["bf16"].append(np.asarray(b16["hidden_states"][:, l]).astype(np.float32))
        per_layer["final norm"]["ref"].append(np.asarray(ref["final_norm_hidden_states"]))
        per_layer["final norm"]["fp8"].append(fdeq)
        per_layer["final norm"]["scales"].append(q["final_norm_hidden_states_scales"])
        per_layer["final norm"]["bf16"].append(np.asarray(b16["final_norm_hidden_states"]).astype(np.float32))
    tokens = sum(len(x) for x in per_layer[names[0]]["ref"])
    hidden = per_layer[names[0]]["ref"][0].shape[-1]
    print(f"\n{preset}: {samples} samples, {tokens} tokens, hidden {hidden}, capture ids 0..{layers} + final norm; "
          f"compute precision {ref.metadata.get('compute_precision', '?')}")
    print(f"{'layer':12} {'rel L2':>10} {'max abs':>10} {'max rel':>10} {'max/amax':>10} {'bf16 rel L2':>12}")
    for name in names:
        d = {k: np.concatenate(v) for k, v in per_layer[name].items()}
        e = layer_errors(d["ref"], d["fp8"], d["scales"])
        b = float(np.linalg.norm(d["bf16"].astype(np.float64) - d["ref"]) / np.linalg.norm(d["ref"].astype(np.float64)))
        print(f"{name:12} {e['rel_l2']:10.4f} {e['max_abs']:10.3g} {e['max_rel']:10.4f} {e['max_over_amax']:10.4f} "
              f"{b:12.2e}")
    print(f"bytes per token per layer: fp8 {hidden + 4}, bf16 {2 * hidden}, fp32 {4 * hidden}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin-dir", default=str(REPO / "build" / "bin"))
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--precision", default="bf16", help="the engine's compute precision (hsx-dump --precision): "
                        "with fp32 the bf16 column is bf16's own rounding error")
    parser.add_argument("--work", help="keep the models and dumps here (default: a temporary directory)")
    args = parser.parse_args()
    import hsx

    with tempfile.TemporaryDirectory(prefix="hsx-fp8-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for preset in args.presets.split(","):
            measure(hsx, Path(args.bin_dir), work, preset, args.samples, args.max_tokens, args.precision)


if __name__ == "__main__":
    main()
