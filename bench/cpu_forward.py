#!/usr/bin/env python3
"""CPU forward benchmark: hsx-dump against Hugging Face transformers.

One run does the following:

1. Generates the `small` random-weight checkpoint with hsx-make-model, or reuses the copy
   cached under ~/.cache/hsx/bench/<preset>/seed<S> (regenerated when the hsx-make-model
   binary changes).
2. Writes a seeded sample set as JSONL: --samples samples, lengths log-uniform in
   [--min-len, --max-len] (long-tailed: many short, a few long; stratified so the whole
   range is covered), random token ids.
3. Runs hsx-dump over it (a private copy of build/bin/hsx-dump, so a concurrent relink
   cannot mix binaries), in fp32 and in bf16 arithmetic, with --threads T, into a temporary
   directory that is removed afterwards. Two times per row: hsx-dump's own (printed by it;
   from after weight loading to the last file written, so file writes are included) and
   this script's wall clock around the whole process (model loading included).
4. Runs transformers' DeepseekV3 (tests/python/hf_oracle.py load_reference) in float32 with
   torch.set_num_threads(T) on the same samples, one sample per forward (batch 1),
   output_hidden_states=True, use_cache=False, on the base model (no lm_head: hsx does not
   compute logits either). Every attention implementation in --hf-attn is crossed with every
   experts implementation in --hf-experts; each combination gets one short warm-up forward,
   then only the forward calls are timed (not model loading). The fastest combination is the
   baseline "HF fp32".
5. Prints a table (engine, tokens, seconds, tokens/s, ratio vs HF fp32, other load) and the
   line `ratio hsx_fp32/hf_fp32 = X`.

Every row is the fastest of --repeat runs (default 2), taken in interleaved rounds so that
a drift of the machine hits all rows alike; a row whose fastest run was contended gets up to
--repeat more. The transformers model is loaded once, before any timing. Both sides use the same samples, the
same thread count and float32 arithmetic; hsx writes every captured layer (--capture all by
default, the layers output_hidden_states returns) to disk as part of its timed work,
transformers only returns them. hsx batches the samples together (--max-batch-tokens), as
its design intends; transformers runs them one at a time, as it is usually run.

Run it with the project's venv (it needs torch, transformers, compressed-tensors):

    ~/.cache/hsx/venv/bin/python bench/cpu_forward.py [--threads T] [--samples N]
        [--max-len L] [--seed S] [--repeat R] [--keep]

Timings are only meaningful on an otherwise idle machine: the script first waits (up to
--wait-idle seconds) for one, and the "other load" column gives the cores that everything
else on the machine kept busy (steal included) during each row; a warning names the rows
where that exceeded 10% of the threads.
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
# hsx-dump's summary line, e.g. "hsx-dump: wrote 16 samples (5475 tokens) to OUT in 7.11 s, 770.4 tokens/s"
# or "hsx-dump: wrote 16 samples, skipped 0 ...; 5475 tokens, ... in 7.11 s, 770.4 tokens/s, ...".
DUMP_SAMPLES = re.compile(r"wrote (\d+) samples")
DUMP_TOKENS = re.compile(r"(\d+) tokens\b(?!/s)")
DUMP_RATE = re.compile(r"in ([0-9.]+) s, ([0-9.]+) tokens/s")


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
    p.add_argument("--repeat", type=int, default=2, help="timed runs per row, the fastest counts (default 2)")
    p.add_argument("--wait-idle", type=float, default=120,
                   help="wait up to this many seconds for an idle machine before measuring (default 120; 0: no)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (samples, hsx outputs)")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = p.parse_args()
    if args.threads < 1 or args.samples < 1 or args.repeat < 1 or not 1 <= args.min_len <= args.max_len:
        p.error("need --threads >= 1, --samples >= 1 and 1 <= --min-len <= --max-len")
    return args


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def busy_seconds() -> float:
    """CPU-seconds all CPUs of the machine spent busy so far (steal included: time the
    hypervisor gave to someone else)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Wall time, this process's (or its children's) CPU time, and the CPU time everything
    else on the machine used meanwhile ("other": competition for the cores)."""

    def __init__(self, children: bool):
        self.children = children

    def own(self) -> float:
        if self.children:
            r = resource.getrusage(resource.RUSAGE_CHILDREN)
            return r.ru_utime + r.ru_stime
        return time.process_time()

    def __enter__(self):
        self.wall0, self.own0, self.busy0 = time.perf_counter(), self.own(), busy_seconds()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = self.own() - self.own0
        # other cores busy on average; /proc/stat ticks are coarse (10 ms), so small values are noise
        self.other = max(0.0, busy_seconds() - self.busy0 - self.cpu) / self.wall


def wait_idle(limit: float):
    """Waits (at most `limit` s) until the machine is idle over a 3 s window."""
    deadline = time.monotonic() + limit
    while True:
        busy0 = busy_seconds()
        time.sleep(3)
        other = (busy_seconds() - busy0) / 3
        if other < 0.1:
            note(f"machine idle ({other:.2f} cores busy)")
            return
        if time.monotonic() > deadline:
            note(f"warning: machine still busy ({other:.2f} cores) after {limit:.0f} s; measuring anyway")
            return
        note(f"waiting for an idle machine ({other:.2f} cores busy)")


def contended(args, row) -> bool:
    """Whether other processes kept more than 10% of the benchmark's threads busy."""
    return row is not None and row["other_load"] > 0.1 * args.threads


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
    """Log-uniform lengths in [min_len, max_len] (many short samples, a long tail of long
    ones), stratified so that every run covers the whole range, in shuffled order."""
    rng = random.Random(f"lengths-{args.seed}")
    lo, hi = math.log(args.min_len), math.log(args.max_len)
    n = args.samples
    lengths = [int(round(math.exp(lo + (i + rng.random()) / n * (hi - lo)))) for i in range(n)]
    rng.shuffle(lengths)
    return lengths


def make_samples(args, vocab: int) -> list:
    rng = random.Random(f"tokens-{args.seed}")
    return [[rng.randrange(vocab) for _ in range(n)] for n in sample_lengths(args)]


class HsxRow:
    """hsx-dump over the samples file, one process per run."""

    def __init__(self, args, dump: Path, model: Path, inputs: Path, work: Path, precision: str,
                 samples: list):
        self.args, self.dump, self.model, self.inputs, self.work = args, dump, model, inputs, work
        self.samples, self.tokens = len(samples), sum(len(ids) for ids in samples)
        self.precision = precision
        self.name = f"hsx-dump {precision}"
        self.runs = 0

    def run(self) -> dict:
        args = self.args
        out = self.work / f"hsx_{self.precision}_{self.runs}"
        cmd = [str(self.dump), "--model", str(self.model), "--input", str(self.inputs), "--out", str(out),
               "--precision", self.precision, "--dtype", "fp32" if self.precision == "fp32" else "bf16",
               "--capture", args.capture, "--max-batch-tokens", str(args.max_batch_tokens),
               "--threads", str(args.threads)]
        if self.runs == 0:
            note(" ".join(cmd))
        self.runs += 1
        time.sleep(1)  # lets the OpenMP workers of a preceding transformers run stop spinning
        with Meter(children=True) as m:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"hsx-dump failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        line = next((l for l in proc.stdout.splitlines() if DUMP_RATE.search(l)), "")
        samples, tokens, rate = DUMP_SAMPLES.search(line), DUMP_TOKENS.search(line), DUMP_RATE.search(line)
        if not (samples and tokens and rate):
            sys.exit(f"hsx-dump: no timing line in its output:\n{proc.stdout}")
        tokens = int(tokens[1])
        if tokens != self.tokens or int(samples[1]) != self.samples:
            sys.exit(f"hsx-dump wrote {samples[1]} samples ({tokens} tokens), expected "
                     f"{self.samples} ({self.tokens}):\n{proc.stdout}{proc.stderr}")
        seconds = tokens / float(rate[2])  # its printed seconds have only two decimals
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
        note(f"{self.name} run {self.runs}: {seconds:.2f} s by its own clock, {tokens / seconds:.1f} "
             f"tokens/s; process {m.wall:.2f} s wall, {m.cpu / m.wall:.2f} cores busy; "
             f"other load {m.other:.2f} cores")
        return {"engine": self.name, "tokens": tokens, "samples": self.samples, "seconds": seconds,
                "wall_seconds": m.wall, "cpu_seconds": m.cpu, "other_load": m.other}


class HfRow:
    """transformers in float32, one sample per forward, with one attention and one experts
    implementation."""

    def __init__(self, args, model, samples: list, attn: str, experts: str):
        import torch
        self.torch, self.model, self.attn, self.experts = torch, model, attn, experts
        self.name = f"HF fp32 attn={attn} experts={experts}"
        self.inputs = [torch.tensor([ids]) for ids in samples]
        self.tokens = sum(len(ids) for ids in samples)
        self.warm = torch.tensor([samples[0][:64]])
        self.runs = 0

    def select(self) -> bool:
        """Switches the model to this row's implementations and warms them up (one short
        forward, not timed); False when they cannot run here."""
        try:
            self.model.set_attn_implementation(self.attn)
            self.model.set_experts_implementation(self.experts)
            with self.torch.inference_mode():
                self.model.model(input_ids=self.warm, output_hidden_states=True, use_cache=False)
        except Exception as e:  # an implementation this torch/transformers cannot run here
            note(f"{self.name}: skipped ({type(e).__name__}: {e})")
            return False
        return True

    def run(self) -> dict:
        self.select()
        self.runs += 1
        layers = len(self.model.model.layers)
        seconds = 0.0
        with Meter(children=False) as m, self.torch.inference_mode():
            for x in self.inputs:
                start = time.perf_counter()
                out = self.model.model(input_ids=x, output_hidden_states=True, use_cache=False)
                seconds += time.perf_counter() - start
                assert len(out.hidden_states) == layers + 1
                del out
        note(f"{self.name} run {self.runs}: {self.tokens} tokens in {seconds:.2f} s, "
             f"{self.tokens / seconds:.1f} tokens/s; {m.cpu / m.wall:.2f} cores busy; "
             f"other load {m.other:.2f} cores")
        return {"engine": self.name, "tokens": self.tokens, "samples": len(self.inputs), "seconds": seconds,
                "cpu_seconds": m.cpu, "other_load": m.other}


def hf_rows(args, model_dir: Path, samples: list) -> list:
    import torch
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    from hf_oracle import load_reference

    torch.set_num_threads(args.threads)
    note(f"loading transformers reference (float32, torch {torch.__version__}, "
         f"{torch.get_num_threads()} threads)")
    start = time.perf_counter()
    model = load_reference(model_dir, torch.float32)
    note(f"loaded in {time.perf_counter() - start:.1f} s (not timed)")
    rows = [HfRow(args, model, samples, attn, experts)
            for attn in args.hf_attn.split(",") for experts in args.hf_experts.split(",")]
    rows = [r for r in rows if r.select()]
    if not rows:
        sys.exit("no transformers configuration could run")
    return rows


def measure(args, rows: list) -> list:
    """Interleaved rounds (every row once per round, so that a slow drift of the machine
    affects all rows alike); each row keeps its fastest run. Rows whose fastest run was
    contended get up to --repeat extra runs."""
    best = {}
    for round_ in range(2 * args.repeat):
        todo = [r for r in rows if round_ < args.repeat or contended(args, best[r.name])]
        if not todo:
            break
        if round_ >= args.repeat:
            note(f"contended: {', '.join(r.name for r in todo)}; one more run each")
            wait_idle(min(args.wait_idle, 30))
        for row in todo:
            result = row.run()
            if row.name not in best or result["seconds"] < best[row.name]["seconds"]:
                best[row.name] = result
    return [best[r.name] for r in rows]


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
        # A private copy: every hsx run uses the same binary even if build/ is relinked meanwhile.
        dump = work / "hsx-dump"
        shutil.copy2(args.bin_dir / "hsx-dump", dump)
        digest = file_sha256(dump)[:12]
        note(f"hsx-dump sha256 {digest}, built "
             f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(dump.stat().st_mtime))}")
        inputs = work / "samples.jsonl"
        inputs.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in samples))
        rows = [HsxRow(args, dump, model, inputs, work, p, samples) for p in args.hsx_precisions.split(",") if p]
        rows += hf_rows(args, model, samples)  # loaded once, before any timing
        if args.wait_idle > 0:
            wait_idle(args.wait_idle)
        results = measure(args, rows)
    finally:
        if args.keep:
            note(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    hf = [r for r in results if r["engine"].startswith("HF")]
    base = max(hf, key=lambda r: r["tokens"] / r["seconds"])
    base_tps = base["tokens"] / base["seconds"]
    print()
    print(f"threads {args.threads}; fastest of {args.repeat} interleaved runs per row (more when contended); "
          f"baseline HF fp32 = {base['engine']} (the fastest transformers configuration)")
    print(f"{'engine':<46} {'tokens':>6} {'seconds':>8} {'tokens/s':>9} {'vs HF fp32':>10} {'other load':>10}")
    table = []
    for r in results:
        table.append((r["engine"], r["tokens"], r["seconds"], r["other_load"]))
        if "wall_seconds" in r:
            table.append((r["engine"] + " (process wall, incl. load)", r["tokens"], r["wall_seconds"],
                          r["other_load"]))
    for engine, tokens, seconds, other in table:
        tps = tokens / seconds
        print(f"{engine:<46} {tokens:>6} {seconds:>8.2f} {tps:>9.1f} {tps / base_tps:>9.2f}x {other:>10.2f}")
    fp32 = next((r for r in results if r["engine"] == "hsx-dump fp32"), None)
    if fp32:
        ratio = (fp32["tokens"] / fp32["seconds"]) / base_tps
        print(f"ratio hsx_fp32/hf_fp32 = {ratio:.2f}")
    busy = [r["engine"] for r in results if contended(args, r)]
    if busy:
        print(f"warning: other processes used the CPUs during {', '.join(busy)} "
              f"(see 'other load', in cores); rerun on an idle machine")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "hsx_dump_sha256": digest, "lengths": lengths,
                                         "rows": results, "baseline": base["engine"]}, indent=1))


if __name__ == "__main__":
    main()
