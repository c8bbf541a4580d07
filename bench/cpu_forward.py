#!/usr/bin/env python3
"""CPU forward benchmark: hsx-dump against Hugging Face transformers (issue 3).

One run does the following:

1. Generates the `small` random-weight checkpoint with hsx-make-model, or reuses the copy
   cached under ~/.cache/hsx/bench/<preset>/seed<S> (regenerated when the hsx-make-model
   binary changes).
2. Writes a seeded sample set as JSONL: --samples samples, lengths log-uniform in
   [--min-len, --max-len] (long-tailed: many short, a few long), random token ids.
3. Runs hsx-dump over it, in fp32 and in bf16 arithmetic, with --threads T, into a temporary
   directory that is removed afterwards. Two times per row: hsx-dump's own (printed by it;
   from after weight loading to the last file written, so file writes are included) and this
   script's wall clock around the whole process (model loading included).
4. Runs transformers' DeepseekV3 (tests/python/hf_oracle.py load_reference) in float32 with
   torch.set_num_threads(T) on the same samples, one sample per forward (batch 1),
   output_hidden_states=True, use_cache=False, on the base model (no lm_head: hsx does not
   compute logits either). Every attention implementation in --hf-attn is crossed with every
   experts implementation in --hf-experts; each combination gets one short warm-up forward,
   then only the forward calls are timed (not model loading). The fastest combination is the
   baseline "HF fp32".
5. Prints a table (engine, tokens, seconds, tokens/s, ratio vs HF fp32) and the line
   `ratio hsx_fp32/hf_fp32 = X`.

Both sides use the same samples, the same thread count and float32 arithmetic; hsx writes
every captured layer (--capture all by default, the same layers output_hidden_states
returns) to disk as part of its timed work, transformers only returns them.

Run it with the project's venv (it needs torch, transformers, compressed-tensors):

    ~/.cache/hsx/venv/bin/python bench/cpu_forward.py [--threads T] [--samples N]
        [--max-len L] [--seed S] [--keep]

The machine should be otherwise idle: the 1-minute load average before and after each phase
is printed, and a warning is given when other processes were competing for the cores.
"""

import argparse
import hashlib
import json
import math
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "hsx" / "bench"
STAMP = "hsx-bench-stamp.json"
DUMP_LINE = re.compile(r"wrote (\d+) samples \((\d+) tokens\) to .* in ([0-9.]+) s, ([0-9.]+) tokens/s")


def parse_args():
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=cores, help=f"threads for both engines (default: all cores, {cores})")
    p.add_argument("--samples", type=int, default=16, help="number of samples (default 16)")
    p.add_argument("--min-len", type=int, default=64, help="shortest sample (default 64)")
    p.add_argument("--max-len", type=int, default=1024, help="longest sample (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the checkpoint and of the samples (default 0)")
    p.add_argument("--preset", default="small", help="hsx-make-model preset (default small)")
    p.add_argument("--capture", default="all", help="hsx-dump --capture (default all, as output_hidden_states)")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="hsx-dump --max-batch-tokens (default 8192)")
    p.add_argument("--hsx-precisions", default="fp32,bf16", help="hsx rows, comma-separated (default fp32,bf16)")
    p.add_argument("--hf-attn", default="eager,sdpa", help="HF attention implementations to try (default eager,sdpa)")
    p.add_argument("--hf-experts", default="grouped_mm,eager",
                   help="HF experts implementations to try (default grouped_mm,eager; grouped_mm is what "
                        "from_pretrained picks; batched_mm gathers a weight copy per token and is "
                        "impractical on CPU)")
    p.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "bin", help="where the hsx binaries are")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (samples, hsx outputs)")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = p.parse_args()
    if args.threads < 1 or args.samples < 1 or not 1 <= args.min_len <= args.max_len:
        p.error("need --threads >= 1, --samples >= 1 and 1 <= --min-len <= --max-len")
    return args


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def note(msg: str):
    print(f"[bench] {msg}", flush=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint(args) -> Path:
    """The cached checkpoint for (preset, seed), made anew when missing or made by another
    hsx-make-model binary."""
    make = args.bin_dir / "hsx-make-model"
    stamp = {"preset": args.preset, "seed": args.seed, "hsx-make-model": file_sha256(make)}
    target = CACHE / args.preset / f"seed{args.seed}"
    try:
        if json.loads((target / STAMP).read_text()) == stamp:
            note(f"reusing checkpoint {target}")
            return target
    except (OSError, ValueError):
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".seed{args.seed}-", dir=target.parent))
    try:
        model = staging / "model"
        subprocess.run([str(make), "--preset", args.preset, "--seed", str(args.seed), "--out", str(model)],
                       check=True, stdout=subprocess.DEVNULL)
        (model / STAMP).write_text(json.dumps(stamp))
        if target.exists():
            shutil.rmtree(target)
        model.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    note(f"generated checkpoint {target}")
    return target


def sample_lengths(args) -> list:
    """Log-uniform lengths in [min_len, max_len]: a long tail of a few long samples."""
    rng = random.Random(f"lengths-{args.seed}")
    lo, hi = math.log(args.min_len), math.log(args.max_len)
    return [int(round(math.exp(rng.uniform(lo, hi)))) for _ in range(args.samples)]


def make_samples(args, vocab: int) -> list:
    rng = random.Random(f"tokens-{args.seed}")
    return [[rng.randrange(vocab) for _ in range(n)] for n in sample_lengths(args)]


def run_hsx(args, model: Path, inputs: Path, work: Path, precision: str) -> dict:
    out = work / f"hsx_{precision}"
    dtype = "fp32" if precision == "fp32" else "bf16"
    cmd = [str(args.bin_dir / "hsx-dump"), "--model", str(model), "--input", str(inputs), "--out", str(out),
           "--precision", precision, "--dtype", dtype, "--capture", args.capture,
           "--max-batch-tokens", str(args.max_batch_tokens), "--threads", str(args.threads)]
    note(" ".join(cmd))
    load = loadavg()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    if proc.returncode != 0:
        sys.exit(f"hsx-dump failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    match = DUMP_LINE.search(proc.stdout)
    if not match:
        sys.exit(f"hsx-dump: no timing line in its output:\n{proc.stdout}")
    samples, tokens = int(match[1]), int(match[2])
    seconds = tokens / float(match[4])  # its printed seconds have only two decimals
    note(proc.stdout.strip() + f" (process wall {wall:.2f} s, "
         f"cpu {cpu:.2f} s = {cpu / wall:.2f} cores busy; load {load:.2f} -> {loadavg():.2f})")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return {"engine": f"hsx-dump {precision}", "tokens": tokens, "samples": samples,
            "seconds": seconds, "wall_seconds": wall, "cpu_seconds": cpu}


def run_hf(args, model_dir: Path, samples: list) -> list:
    import torch
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    from hf_oracle import load_reference

    torch.set_num_threads(args.threads)
    note(f"loading transformers reference (float32, torch {torch.__version__}, {torch.get_num_threads()} threads)")
    start = time.perf_counter()
    model = load_reference(model_dir, torch.float32)
    note(f"loaded in {time.perf_counter() - start:.1f} s (not timed)")
    tokens = sum(len(s) for s in samples)
    warm = torch.tensor([samples[0][:min(len(samples[0]), 64)]])
    rows = []
    for attn in args.hf_attn.split(","):
        for experts in args.hf_experts.split(","):
            name = f"HF fp32 attn={attn} experts={experts}"
            try:
                model.set_attn_implementation(attn)
                model.set_experts_implementation(experts)
                with torch.inference_mode():
                    model.model(input_ids=warm, output_hidden_states=True, use_cache=False)
            except Exception as e:  # an implementation this torch/transformers cannot run here
                note(f"{name}: skipped ({type(e).__name__}: {e})")
                continue
            load = loadavg()
            seconds = cpu = 0.0
            with torch.inference_mode():
                for ids in samples:
                    x = torch.tensor([ids])
                    cpu0 = time.process_time()
                    start = time.perf_counter()
                    out = model.model(input_ids=x, output_hidden_states=True, use_cache=False)
                    seconds += time.perf_counter() - start
                    cpu += time.process_time() - cpu0
                    assert len(out.hidden_states) == len(model.model.layers) + 1
                    del out
            note(f"{name}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tokens/s "
                 f"(cpu {cpu / seconds:.2f} cores busy; load {load:.2f} -> {loadavg():.2f})")
            rows.append({"engine": name, "tokens": tokens, "samples": len(samples), "seconds": seconds,
                         "cpu_seconds": cpu})
    if not rows:
        sys.exit("no transformers configuration could run")
    return rows


def main():
    args = parse_args()
    for tool in ("hsx-make-model", "hsx-dump"):
        if not (args.bin_dir / tool).exists():
            sys.exit(f"{args.bin_dir / tool} is missing; build first (ninja -C build)")
    cores = len(os.sched_getaffinity(0))
    note(f"threads {args.threads} of {cores} cores; load average {loadavg():.2f}")
    model = checkpoint(args)
    vocab = json.loads((model / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    samples = make_samples(args, vocab)
    lengths = [len(s) for s in samples]
    note(f"{len(samples)} samples, {sum(lengths)} tokens, lengths {sorted(lengths)}")

    work = Path(tempfile.mkdtemp(prefix="hsx-bench-"))
    try:
        inputs = work / "samples.jsonl"
        inputs.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in samples))
        hsx_rows = [run_hsx(args, model, inputs, work, p) for p in args.hsx_precisions.split(",") if p]
        hf_rows = run_hf(args, model, samples)
    finally:
        if args.keep:
            note(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    base = max(hf_rows, key=lambda r: r["tokens"] / r["seconds"])
    base_tps = base["tokens"] / base["seconds"]
    print()
    print(f"baseline HF fp32 = {base['engine']} (fastest transformers configuration)")
    print(f"{'engine':<44} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'vs HF fp32':>10}")
    table = []
    for r in hsx_rows + hf_rows:
        table.append((r["engine"], r["tokens"], r["seconds"]))
        if "wall_seconds" in r:
            table.append((r["engine"] + " (process wall, incl. load)", r["tokens"], r["wall_seconds"]))
    for engine, tokens, seconds in table:
        tps = tokens / seconds
        print(f"{engine:<44} {tokens:>7} {seconds:>8.2f} {tps:>9.1f} {tps / base_tps:>9.2f}x")
    fp32 = next((r for r in hsx_rows if r["engine"] == "hsx-dump fp32"), None)
    if fp32:
        ratio = (fp32["tokens"] / fp32["seconds"]) / base_tps
        print(f"ratio hsx_fp32/hf_fp32 = {ratio:.2f}")
    if loadavg() > args.threads + 0.5 or cores > args.threads and loadavg() > cores:
        print(f"warning: load average {loadavg():.2f} on {cores} cores; other processes may have "
              f"competed for the CPUs, rerun on an idle machine")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "lengths": lengths, "rows": hsx_rows + hf_rows,
                                         "baseline": base["engine"]}, indent=1))


if __name__ == "__main__":
    main()
