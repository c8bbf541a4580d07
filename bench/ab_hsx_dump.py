#!/usr/bin/env python3
"""A/B of two hsx-dump builds on bench/cpu_forward.py's checkpoint and samples.

Answers "is this change slower on the CPU?" without transformers in the loop: the same
`small` checkpoint and the same seeded samples as bench/cpu_forward.py, hsx-dump --model
from a baseline build (--baseline-bin, e.g. a copy of build/bin made before the change)
and from the candidate (--bin), in interleaved rounds (A, B, A, B, ...) so that a drift of
the machine, or a neighbour's load, hits both alike. Prints per precision the median and
range of tokens/s (hsx-dump's own clock) and of CPU-seconds per 1000 tokens (the process's
user + system time, which a busy machine disturbs far less than wall time) of each build,
and the ratios of the medians, candidate / baseline.

    ~/.cache/hsx/venv/bin/python bench/ab_hsx_dump.py --baseline-bin /tmp/old-bin \\
        [--bin build/bin] [--rounds 5] [--hsx-precisions fp32,bf16] [cpu_forward.py options]
"""

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_forward as cf  # noqa: E402  (the same checkpoint, samples and hsx-dump runner)


def main():
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--baseline-bin", type=Path, required=True, help="directory with the baseline hsx-dump")
    own.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    mine, rest = own.parse_known_args()
    sys.argv = [sys.argv[0]] + rest
    args = cf.parse_args()
    model = cf.checkpoint(args)
    vocab = cf.json.loads((model / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    samples = cf.make_samples(args, vocab)
    work = Path(tempfile.mkdtemp(prefix="hsx-ab-"))
    try:
        inputs = work / "samples.jsonl"
        inputs.write_text("".join(cf.json.dumps({"input_ids": s}) + "\n" for s in samples))
        rows = {}
        for label, bin_dir in (("baseline", mine.baseline_bin), ("candidate", args.bin_dir)):
            dump = work / f"hsx-dump-{label}"
            shutil.copy2(bin_dir / "hsx-dump", dump)
            cf.note(f"{label}: {bin_dir / 'hsx-dump'} sha256 {cf.file_sha256(dump)[:12]}")
            for precision in args.hsx_precisions.split(","):
                rows[(label, precision)] = cf.HsxRow(args, dump, model, inputs, work, precision, samples)
        if args.wait_idle > 0:
            cf.wait_idle(args.wait_idle)
        rates = {key: [] for key in rows}
        cpu = {key: [] for key in rows}
        for _ in range(mine.rounds):
            for key, row in rows.items():
                result = row.run()
                rates[key].append(result["tokens"] / result["seconds"])
                cpu[key].append(1000 * result["cpu_seconds"] / result["tokens"])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"{len(samples)} samples, {sum(len(s) for s in samples)} tokens; threads {args.threads}; "
          f"{mine.rounds} interleaved rounds; tokens/s median [min, max]")
    def line(values):
        return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"

    for precision in args.hsx_precisions.split(","):
        base, cand = rates[("baseline", precision)], rates[("candidate", precision)]
        print(f"{precision} tokens/s: baseline {line(base)}, candidate {line(cand)}, "
              f"ratio candidate/baseline = {statistics.median(cand) / statistics.median(base):.3f}")
        base, cand = cpu[("baseline", precision)], cpu[("candidate", precision)]
        print(f"{precision} CPU-s per 1000 tokens: baseline {line(base)}, candidate {line(cand)}, "
              f"speed ratio (baseline/candidate CPU) = {statistics.median(base) / statistics.median(cand):.3f}")


if __name__ == "__main__":
    main()
