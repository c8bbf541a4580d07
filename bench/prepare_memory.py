#!/usr/bin/env python3
"""Peak memory of python -m hsx.prepare against the size of its input: it must stay flat.

Generates chat JSONL files of the given sizes under a temporary directory (multi-turn OpenAI
conversations of about 4 KiB each, seeded words, ASCII and non-ASCII, every fifth with a thinking
block), runs hsx.prepare on each with the Kimi K2-Thinking fixture template and a byte-level BPE
tokenizer trained at start (tests/python/prepare_helpers.py), and prints for each size
hsx.prepare's peak RSS (ru_maxrss from os.wait4 in a small wrapper process, so that the
benchmark's own memory is not counted), its wall time and throughput. Everything it generated is
deleted at the end.

    python bench/prepare_memory.py [--sizes 100M,1G] [--model DIR] [--tmp /tmp]

Needs transformers and tokenizers (the test environment) and the hsx package importable (as in
the tests: installed, or PYTHONPATH). The ratio that matters: peak RSS at the largest size over
the smallest, which is about 1 when memory is flat.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when what if more no out so said up its "
         "café naïve Straße 日本語 数据 модель κόσμος 🙂").split()


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def generate(path: Path, size: int, seed: int = 0) -> int:
    """Writes about `size` bytes of conversations; returns the number of lines."""
    rng = random.Random(seed)
    lines = written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            messages = [{"role": "system", "content": _words(rng, 20)}]
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": _words(rng, rng.randint(30, 120))})
                answer = {"role": "assistant", "content": _words(rng, rng.randint(150, 400))}
                if lines % 5 == 0:
                    answer["reasoning_content"] = _words(rng, 60)
                messages.append(answer)
            line = json.dumps({"id": lines, "messages": messages}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            lines += 1
    return lines


def fixture_model(root: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "python"))
    from prepare_helpers import model_dir
    return model_dir(root, "kimi-k2-thinking")


# Runs argv[1:] and prints its peak RSS in KiB. A small process of its own: a child's ru_maxrss
# starts from the RSS of the process it was forked from (Linux keeps the larger across exec), so
# forking hsx.prepare straight from this benchmark (or from pytest), with transformers already
# imported, would report the parent's size whenever that is larger.
PEAK_RSS_WRAPPER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(f"peak_rss_kib={usage.ru_maxrss}", file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(cmd: list) -> tuple:
    """(exit status, stderr without the wrapper's line, peak RSS of cmd in MiB)."""
    proc = subprocess.run([sys.executable, "-S", "-c", PEAK_RSS_WRAPPER, *cmd], stderr=subprocess.PIPE, text=True)
    lines = proc.stderr.splitlines()
    peak = [int(line.split("=")[1]) for line in lines if line.startswith("peak_rss_kib=")]
    rest = "\n".join(line for line in lines if not line.startswith("peak_rss_kib="))
    return proc.returncode, rest, (peak[-1] / 1024 if peak else float("nan"))


def measure(model: Path, source: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "hsx.prepare", "--model", str(model), "--input", str(source), "--output",
           str(out), "--no-progress", "--checkpoint-every", "5000"]
    start = time.monotonic()
    code, stderr, peak = run_measured(cmd)
    seconds = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"hsx.prepare failed ({code}): {stderr}")
    return {"peak_rss_mib": peak, "seconds": seconds, "summary": stderr.strip().splitlines()[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100M,1G", help="input sizes, comma-separated (K, M, G suffixes)")
    p.add_argument("--model", type=Path, help="model directory (default: the fixture tokenizer, built here)")
    p.add_argument("--tmp", default=tempfile.gettempdir(), help="where the inputs are generated")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsx-prepare-memory-", dir=args.tmp))
    try:
        model = args.model or fixture_model(work)
        print("| input | lines | peak RSS (MiB) | wall (s) | MB/s |")
        print("|---|---:|---:|---:|---:|")
        for text in args.sizes.split(","):
            source = work / f"chats-{text}.jsonl"
            lines = generate(source, _size(text))
            actual = source.stat().st_size
            result = measure(model, source, work / f"out-{text}.jsonl")
            print(f"| {actual / 1e6:.0f} MB | {lines} | {result['peak_rss_mib']:.1f} | {result['seconds']:.0f} | "
                  f"{actual / 1e6 / result['seconds']:.2f} |", flush=True)
            print(f"<!-- {result['summary']} -->", flush=True)
            for path in work.glob(f"*{text}*"):
                path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
